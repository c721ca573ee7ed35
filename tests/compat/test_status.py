"""TransferStatus and wait_all: MoRI-IO's semantics, the GIL released while waiting."""

from __future__ import annotations

import logging
import threading
import time

import pytest

import moriio_async
from moriio_async.compat.mori import StatusCode, TransferStatus, set_log_level, wait_all
from moriio_async.compat.mori import status as status_module


def in_progress() -> TransferStatus:
    status = TransferStatus()
    status.SetCode(StatusCode.IN_PROGRESS)
    return status


def ended(code: StatusCode, message: str = "") -> TransferStatus:
    status = TransferStatus()
    status.Update(code, message)
    return status


def later(delay: float, fn: object, *args: object) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)
        fn(*args)  # type: ignore[operator]

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_the_codes_are_moriio_async_s_one_for_one() -> None:
    # compat's enum takes its values from moriio_async's table member by member (an IntEnum with members
    # cannot be extended, and this one prints as pybind11 does): no member may be left out or added.
    assert [(c.name, int(c)) for c in StatusCode] == [(c.name, int(c)) for c in moriio_async.StatusCode]


def test_status_surface_and_codes_print_as_mori_does() -> None:
    status = TransferStatus()
    assert status.Init() and not status.InProgress() and not status.Failed() and status.Message() == ""
    assert status.WaitFor(-1) is StatusCode.INIT  # not in progress: returns at once, as in MoRI-IO
    status.SetCode(StatusCode.IN_PROGRESS)
    assert status.InProgress() and status.WaitFor(0) is StatusCode.IN_PROGRESS
    status.Update(StatusCode.ERR_RDMA_OP, "boom")
    assert status.Failed() and status.Code() == moriio_async.StatusCode.ERR_RDMA_OP == 13
    status.Update(StatusCode.SUCCESS, "late")  # a failure is latched
    assert status.Code() is StatusCode.ERR_RDMA_OP and status.Message() == "boom"
    status.SetMessage("replaced")
    assert status.Message() == "replaced"
    assert f"(code={status.Code()})" == "(code=StatusCode.ERR_RDMA_OP)"
    assert str(StatusCode.SUCCESS) == "StatusCode.SUCCESS" and f"{StatusCode.INIT:d}" == "1"


def test_codes_format_as_their_name_for_text_specs_and_as_their_number_for_numeric_ones() -> None:
    """As a pybind11 enum: a spec of type ``s`` formats ``StatusCode.NAME``; ``d``, ``x``, ``X`` the number."""
    code = StatusCode.ERR_RDMA_OP
    assert f"{code}" == f"{code:s}" == "StatusCode.ERR_RDMA_OP"
    assert f"{code:>24s}" == "  StatusCode.ERR_RDMA_OP"
    assert (f"{code:d}", f"{code:x}", f"{code:X}", f"{code:4d}") == ("13", "d", "D", "  13")


def test_wait_for_returns_the_code_at_the_deadline_and_after_an_update() -> None:
    status = in_progress()
    t0 = time.monotonic()
    assert status.WaitFor(50) is StatusCode.IN_PROGRESS
    assert time.monotonic() - t0 >= 0.045
    thread = later(0.02, status.Update, StatusCode.ERR_BAD_STATE, "gone")
    assert status.WaitFor(5000) is StatusCode.ERR_BAD_STATE
    thread.join()
    other = in_progress()
    thread = later(0.02, other.Update, StatusCode.SUCCESS, "")
    other.Wait()
    assert other.Succeeded()
    thread.join()


def test_wait_releases_the_gil_for_other_threads() -> None:
    status = in_progress()
    stop = threading.Event()
    counter = [0]

    def spin() -> None:
        while not stop.is_set():
            counter[0] += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    time.sleep(0.01)
    before = counter[0]
    updater = later(0.2, status.Update, StatusCode.SUCCESS, "")
    cpu = time.thread_time()
    status.Wait()
    cpu = time.thread_time() - cpu
    during = counter[0] - before
    stop.set()
    spinner.join()
    updater.join()
    # The other thread ran all along, and the waiter slept instead of polling (a poll burns its CPU time).
    assert during > 100_000, during
    assert cpu < 0.05, cpu


def test_wait_all_rules() -> None:
    assert wait_all([]) is StatusCode.SUCCESS
    assert wait_all([None, ended(StatusCode.SUCCESS)], 0) is StatusCode.SUCCESS
    # zero timeout: a failure anywhere wins; otherwise anything pending makes it IN_PROGRESS
    done, pending, failed = ended(StatusCode.SUCCESS), in_progress(), ended(StatusCode.ERR_RDMA_OP)
    assert wait_all([done, pending, failed], timeout_ms=0) is StatusCode.ERR_RDMA_OP
    assert wait_all([done, pending], timeout_ms=0) is StatusCode.IN_PROGRESS
    # bounded: the first failure seen wins over a pending one at the deadline
    assert wait_all([failed, in_progress()], timeout_ms=30) is StatusCode.ERR_RDMA_OP
    t0 = time.monotonic()
    assert wait_all([in_progress(), done], timeout_ms=30) is StatusCode.IN_PROGRESS
    assert 0.025 < time.monotonic() - t0 < 1
    # unbounded: every status is waited for, and the first failure in list order is the answer
    slow_fail, quick_fail = in_progress(), in_progress()
    threads = [
        later(0.05, slow_fail.Update, StatusCode.ERR_BAD_STATE, ""),
        later(0.01, quick_fail.Update, StatusCode.ERR_INVALID_ARGS, ""),
    ]
    assert wait_all([slow_fail, quick_fail, ended(StatusCode.SUCCESS)]) is StatusCode.ERR_BAD_STATE
    for thread in threads:
        thread.join()


@pytest.mark.parametrize("code", [StatusCode.SUCCESS, StatusCode.ERR_RDMA_OP])
def test_set_code_wakes_waiters_for_terminal_codes(code: StatusCode) -> None:
    status = in_progress()
    thread = later(0.02, status.SetCode, code)
    assert status.WaitFor(5000) is code
    thread.join()


class FakeClock:
    """``time`` for the status module, with a ``monotonic`` only the test moves (the rest is the real one)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


class EndsAt(TransferStatus):
    """A status that ends with SUCCESS at ``at`` on the fake clock: a wait of ``timeout_ms`` moves the clock
    to the end (or by the whole timeout, if it ends later), as a real wait would spend that time."""

    def __init__(self, clock: FakeClock, at: float, code: StatusCode = StatusCode.SUCCESS) -> None:
        super().__init__()
        self.SetCode(StatusCode.IN_PROGRESS)
        self.clock, self.at, self.code = clock, at, code
        self.waits: list[int] = []

    def WaitFor(self, timeout_ms: int = -1) -> StatusCode:
        self.waits.append(timeout_ms)
        if self.Code() is StatusCode.IN_PROGRESS and timeout_ms != 0:
            reach = self.clock.now + (timeout_ms / 1000 if timeout_ms > 0 else float("inf"))
            if self.at <= reach:
                self.clock.now = max(self.clock.now, self.at)
                self.Update(self.code, "")
            else:
                self.clock.now = reach
        return self.Code()


def test_wait_all_with_time_left_waits_for_each_status_within_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each status gets the time left until wait_all's deadline, so statuses that end before it succeed;
    only one ending after it makes the answer IN_PROGRESS. Never a look and a give-up with time left."""
    clock = FakeClock()
    monkeypatch.setattr(status_module, "time", clock)
    start = clock.now
    first, second = EndsAt(clock, start + 0.6), EndsAt(clock, start + 0.9)
    assert wait_all([first, second], timeout_ms=1000) is StatusCode.SUCCESS
    assert first.waits == [1000] and 399 <= second.waits[0] <= 400  # the deadline is wait_all's, not per status
    assert clock.now == start + 0.9
    clock.now = start = 2000.0
    late, never_asked = EndsAt(clock, start + 1.5), EndsAt(clock, start + 0.1)
    assert wait_all([late, never_asked], timeout_ms=1000) is StatusCode.IN_PROGRESS
    assert late.waits == [1000] and clock.now == start + 1.0
    assert never_asked.waits == []  # the deadline had passed: not waited on
    clock.now = start = 3000.0
    forever = EndsAt(clock, start + 3600)
    assert wait_all([forever]) is StatusCode.SUCCESS and forever.waits == [-1]  # no deadline: waits it out


def test_wait_all_at_its_deadline_asks_no_more_statuses_and_answers_the_failure_seen_else_in_progress(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = FakeClock()
    monkeypatch.setattr(status_module, "time", clock)
    start = clock.now
    # the first status ends exactly at the deadline: the next one, which would end a moment later, is not asked
    on_time, next_one = EndsAt(clock, start + 1.0), EndsAt(clock, start + 1.0005)
    assert wait_all([on_time, next_one], timeout_ms=1000) is StatusCode.IN_PROGRESS and next_one.waits == []
    clock.now = start = 2000.0
    failing, unasked = EndsAt(clock, start + 1.0, StatusCode.ERR_RDMA_OP), EndsAt(clock, start + 1.0005)
    assert wait_all([failing, unasked], timeout_ms=1000) is StatusCode.ERR_RDMA_OP and unasked.waits == []
    # with under a millisecond and a half left, the next status is asked for 1 ms (the floor), not more
    clock.now = start = 3000.0
    first, second = EndsAt(clock, start + 0.9985), EndsAt(clock, start + 0.999)
    assert wait_all([first, second], timeout_ms=1000) is StatusCode.SUCCESS and second.waits == [1]


def test_wait_all_with_a_zero_timeout_only_looks(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(status_module, "time", clock)
    about_to_end = EndsAt(clock, clock.now + 0.0005)
    assert wait_all([about_to_end], timeout_ms=0) is StatusCode.IN_PROGRESS and about_to_end.waits == [0]


def test_set_log_level_takes_mori_ios_level_names_in_any_case() -> None:
    logger = logging.getLogger("moriio_async")
    saved = logger.level
    try:
        for name, level in [("trace", logging.DEBUG), ("Info", logging.INFO), ("WARN", logging.WARNING),
                            ("error", logging.ERROR)]:  # fmt: skip
            set_log_level(name)
            assert logger.level == level
        set_log_level("off")
        assert not logger.isEnabledFor(logging.CRITICAL)
        with pytest.raises(ValueError, match=r"^unknown log level 'loud': choose one of \['critical', 'debug', "):
            set_log_level("loud")
        assert logger.level == logging.CRITICAL + 10  # a refused name changes nothing
    finally:
        logger.setLevel(saved)
