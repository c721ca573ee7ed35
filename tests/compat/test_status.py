"""TransferStatus and wait_all: MoRI-IO's semantics, the GIL released while waiting."""

from __future__ import annotations

import threading
import time

import pytest

import moriio_async
from moriio_async.compat.mori import StatusCode, TransferStatus, wait_all


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


def test_status_surface_and_codes_print_as_mori_does() -> None:
    status = TransferStatus()
    assert status.Init() and not status.InProgress() and not status.Failed()
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
