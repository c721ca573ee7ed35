"""Spinning on a status check (MoRI-IO's ``while status.InProgress(): pass``) lets the engine progress.

Not a timing test: the GIL's switch interval is raised to a second while a caller spins, so a loop thread (or
any other Python thread) gets to run only if the checks themselves give the GIL up; each transfer must then end
within a bounded number of checks, far fewer than a spinner holding the GIL makes before the interval ends.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator

import pytest

from moriio_async.compat.mori import IOEngine, StatusCode, TransferStatus
from moriio_async.compat.mori import status as status_module

from .conftest import on_loop, register

CHECKS = 10_000
"""Checks allowed per transfer: a spin check waits up to SPIN_WAIT (1 ms) for the end, so this allows 10 s;
a spinner holding the GIL makes them all in about a millisecond, long before the switch interval gives way."""

SPINS: dict[str, Callable[[TransferStatus], bool]] = {
    "InProgress": lambda s: s.InProgress(),
    "Code": lambda s: s.Code() is StatusCode.IN_PROGRESS,
    "Succeeded/Failed": lambda s: not (s.Succeeded() or s.Failed()),
}


@pytest.fixture
def long_switch_interval() -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    yield
    sys.setswitchinterval(old)


def spin(pending: Callable[[], bool]) -> int:
    """Check until ``pending()`` is false, at most CHECKS times; the number of checks made."""
    for n in range(1, CHECKS + 1):
        if not pending():
            return n
    raise AssertionError(f"still pending after {CHECKS} checks: the spinning thread kept the GIL")


@pytest.mark.usefixtures("long_switch_interval")
@pytest.mark.parametrize("check", list(SPINS))
def test_a_spinning_caller_completes_transfers_while_the_loop_thread_runs(
    pair: tuple[IOEngine, IOEngine], check: str
) -> None:
    a, b = pair
    buf_a, mem_a = register(a, 8192, fill=0)
    buf_b, mem_b = register(b, 8192)
    session = a.create_session(mem_a, mem_b)
    assert session is not None
    pending = SPINS[check]
    for i in range(20):
        buf_b[:] = i
        status = session.read(0, 0, 8192)
        spin(lambda: pending(status))  # noqa: B023 -- called before the next iteration
        assert status.Code() is StatusCode.SUCCESS, status.Message()
        assert (buf_a == i).all()


@pytest.mark.usefixtures("long_switch_interval")
def test_spinning_on_init_lets_another_thread_update_the_status() -> None:
    status = TransferStatus()
    go = threading.Event()
    updater = threading.Thread(target=lambda: (go.wait(), status.Update(StatusCode.SUCCESS, "")))
    updater.start()
    go.set()  # the updater is runnable from here, but needs the GIL
    spin(status.Init)
    updater.join()
    assert status.Succeeded()


def test_a_single_check_or_one_on_the_loop_thread_does_not_wait(
    held: tuple[IOEngine, IOEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller that checks now and then is answered at once; so is the loop thread (which ends statuses)."""
    monkeypatch.setattr(status_module, "SPIN_WAIT", 3600.0)  # a wait would outlast the test's timeout
    a, b = held
    _, mem_a = register(a, 8192)
    _, mem_b = register(b, 8192)
    session = a.create_session(mem_a, mem_b)
    assert session is not None
    status = session.write(0, 0, 8192)  # held by the mock NIC: in progress until stepped
    assert status.InProgress()
    assert on_loop(a, lambda: [status.InProgress() for _ in range(3)]) == [True] * 3
    for stripe in session.stripes:
        on_loop(a, stripe.channel.qp.step, 1 << 20)
    monkeypatch.setattr(status_module, "SPIN_WAIT", 1e-3)
    assert status.WaitFor(10_000) is StatusCode.SUCCESS
