"""A pair that fails in the middle of a WRITE stream (issue 23, item 1): every request taken for
sending ends exactly once (the first failure, then flushes), no pin on the initiator's buffer
outlives the stream's end, and deregistering that buffer returns.

The failures: the target deregisters the region being written (which is normal: REM_ACCESS_ERR),
a request names a bad rkey (REM_ACCESS_ERR), the target's pair goes away (the peer's death, as
far as this pair can tell), and a local ``to_error``.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest

from moriio_async.backends import open_backend
from moriio_async.backends.tcp import Fault, Hooks, TcpQueuePair, TcpRegion
from moriio_async.backends.tcp.wire import VendorErr
from moriio_async.status import Access, WcStatus

from .failing import FAILURES, assert_ended_once_in_rc_order, deregisters, own_pins, returns, stream_and_fail
from .harness import WAIT, PairFactory, make_options, statuses

pytestmark = pytest.mark.timeout(120)

SIZE = 16 << 20


@pytest.mark.parametrize("failure", FAILURES)
def test_a_pair_failed_mid_stream_ends_every_write_and_keeps_no_pin(pairs: PairFactory, failure: str) -> None:
    for attempt in range(6):  # the race (a doorbell's partial write against the failure) is timing-bound
        pair = pairs(SIZE, SIZE, sq_depth=64)
        wcs = stream_and_fail(pair, failure, fail_at=40 + 7 * attempt, total=160)
        assert_ended_once_in_rc_order(wcs, 160)
        assert any(wc.status is not WcStatus.SUCCESS for wc in wcs)
        assert own_pins(pair.a.mr) == 0, f"attempt {attempt}: {own_pins(pair.a.mr)} pins outlived the stream"
        assert deregisters(pair.a.deregister, pair.a.mr), "deregistering the initiator's buffer hangs"


@pytest.mark.only_backends("tcp", reason="drives the TCP doorbell's partial write against a failure")
def test_a_doorbell_write_left_over_as_its_pair_fails_is_released(
    pairs: PairFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pair fails while a post's own write is in its socket call, and the socket took none of
    it: the sender thread has left by then, so the leftover must not be parked for it (it was, and
    its pin on the initiator's buffer stayed forever: deregistration then never returned)."""
    pair = pairs(1 << 20, 1 << 20)
    qp = pair.a.qp
    assert isinstance(qp, TcpQueuePair)
    st = qp.pair_state
    sender = next(t for t in qp._threads if "send" in t.name)

    class FailsMidCall:
        """The doorbell's held send: the pair fails meanwhile (on another thread), nothing is taken."""

        def send(self, fd: int, head: bytes, blocks: list[tuple[int, int]]) -> int:
            failing = threading.Thread(target=qp.to_error)
            failing.start()
            failing.join(WAIT)
            # The sender sees ERR: it used to leave at once; now it waits for tx_lock (held by this
            # post) to release what is parked. Either way, give it the time to do what it does.
            sender.join(1.0)
            return -1

    monkeypatch.setattr(st, "held", FailsMidCall())
    pair.a.qp.post_send([pair.write(1, 0, 4096, 0)])
    assert statuses(pair.waiter.wait(1)) == [WcStatus.WR_FLUSH_ERR]
    sender.join(WAIT)
    assert not sender.is_alive()
    assert st.tx_pending is None
    assert own_pins(pair.a.mr) == 0
    assert deregisters(pair.a.deregister, pair.a.mr), "deregistering the initiator's buffer hangs"


@pytest.mark.only_backends("tcp", reason="the TCP backend's region table at close")
def test_closing_the_backend_returns_even_with_a_pin_left(caplog: pytest.LogCaptureFixture) -> None:
    """A pin nothing will release (what the leaked write above left) must not make ``close`` wait
    for ever: by then every NIC thread is joined, so no socket call can touch the buffer."""
    backend = open_backend("tcp", make_options("tcp"))
    buf = np.zeros(4096, np.uint8)
    mr = backend.register_memory(memoryview(buf), Access.all())
    assert isinstance(mr, TcpRegion) and mr.pin()
    with caplog.at_level(logging.WARNING, "moriio_async.tcp"):
        assert returns(backend.close), "closing the backend hangs on a leaked pin"
    assert "a leak" in caplog.text


@pytest.mark.only_backends("tcp", reason="a stalled TCP target, through the backend's fault hooks")
def test_deregistering_a_buffer_a_stalled_peer_is_being_sent_fails_the_write_instead_of_waiting(
    pairs: PairFactory,
) -> None:
    """A WRITE from the initiator's buffer to a target that stopped reading: its send blocks, with the
    buffer pinned. Deregistering the buffer used to wait for that send, i.e. for the peer (up to the
    send timeout, renewed by every byte the peer reads); now it aborts the pair's socket call: the
    WRITE fails LOC_PROT_ERR (LOCAL_DEREGISTERED) and the deregistration returns at once."""
    stalled, release = threading.Event(), threading.Event()

    class Stall(Hooks):
        def on_request(self, qp_num: int, opcode: int, rkey: int, remote_addr: int, length: int) -> Fault | None:
            stalled.set()
            release.wait(WAIT * 4)
            return None

    size = 64 << 20  # far more than the loopback socket buffers hold: the sender's call blocks
    pair = pairs(size, size, retry_timeout=60.0)
    pair.b.qp.hooks = Stall()
    try:
        pair.a.qp.post_send([pair.write(1, 0, size, 0)])
        assert stalled.wait(WAIT)
        assert deregisters(pair.a.deregister, pair.a.mr), "deregistering waited for the stalled peer"
        (wc,) = pair.waiter.wait(1)
        assert (wc.status, wc.vendor_err) == (WcStatus.LOC_PROT_ERR, VendorErr.LOCAL_DEREGISTERED)
    finally:
        release.set()
