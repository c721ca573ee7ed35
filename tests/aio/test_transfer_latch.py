"""``aio.transfer.Transfer`` on its own: the status surface, the latch, awaiting, done callbacks and
watchers, driven directly (no engine) so each outcome and message can be stated exactly."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from moriio_async.aio.transfer import Transfer
from moriio_async.errors import TransferFailed
from moriio_async.status import Opcode, StatusCode, WcStatus


def make(
    transfer_id: int = 5,
    *,
    lo: Any = (0, 8),
    ro: Any = (16, 32),
    sz: Any = (8, 16),
    opcode: Opcode = Opcode.RDMA_WRITE,
    drainer: Any = None,
    uid: int | None = None,
) -> Transfer:
    return Transfer(asyncio.get_running_loop(), transfer_id, opcode, "peer-b", lo, ro, sz, drainer=drainer, uid=uid)


class Watch:
    def __init__(self, log: list[Any] | None = None, name: str = "w") -> None:
        self.closed = False
        self.seen: list[Transfer] = []
        self.log = log
        self.name = name

    def ended(self, transfer: Transfer) -> None:
        self.seen.append(transfer)
        if self.log is not None:
            self.log.append(self.name)


def surface(t: Transfer) -> tuple[int, str, bool, bool, bool, bool, bool]:
    return (t.Code(), t.Message(), t.Init(), t.InProgress(), t.Succeeded(), t.Failed(), t.done())


async def test_a_new_transfer_is_init_and_keeps_what_it_was_given() -> None:
    drainer = object()
    t = make(7, drainer=drainer, uid=99, opcode=Opcode.RDMA_READ)
    assert (t.id, t.uid, t.opcode, t.peer) == (7, 99, Opcode.RDMA_READ, "peer-b")
    assert t.drainer is drainer
    assert t.code is StatusCode.INIT
    assert surface(t) == (1, "", True, False, False, False, False)
    assert t.error() is None
    assert (t.local_offsets, t.remote_offsets, t.sizes, t.nbytes) == ((0, 8), (16, 32), (8, 16), 24)
    assert make().uid is None and make().drainer is None


async def test_offsets_and_sizes_from_arrays_are_tuples_of_python_ints() -> None:
    lo, ro, sz = (np.array(v, dtype=np.int64) for v in ([0, 4096], [8192, 0], [4096, 100]))
    t = make(lo=lo, ro=ro, sz=sz)
    assert (t.local_offsets, t.remote_offsets, t.sizes) == ((0, 4096), (8192, 0), (4096, 100))
    assert all(type(v) is int for v in (*t.local_offsets, *t.remote_offsets, *t.sizes))
    assert t.nbytes == 4196 and type(t.nbytes) is int
    assert make(sz=[3, 4, 5]).nbytes == 12


async def test_start_then_the_last_completion_succeeds() -> None:
    t = make()
    t.start(3)
    assert t.code is StatusCode.IN_PROGRESS
    assert surface(t) == (2, "", False, True, False, False, False)
    t.settle(2, WcStatus.SUCCESS)
    assert surface(t) == (2, "", False, True, False, False, False)
    t.settle(1, WcStatus.SUCCESS)
    assert t.code is StatusCode.SUCCESS
    assert surface(t) == (0, "", False, False, True, False, True)
    assert t.error() is None
    await t  # a succeeded transfer awaits to None at once
    assert repr(t) == "<Transfer 5 RDMA_WRITE 24B to peer-b SUCCESS>"


async def test_settle_before_start_is_ignored() -> None:
    t = make()
    t.settle(1, WcStatus.REM_ACCESS_ERR)
    assert surface(t) == (1, "", True, False, False, False, False)
    assert repr(t) == "<Transfer 5 RDMA_WRITE 24B to peer-b INIT>"


async def test_a_failed_completion_fails_with_every_detail() -> None:
    t = make(lo=[0, 8], ro=np.array([16, 32], dtype=np.int64))
    t.start(2)
    t.settle(1, WcStatus.REM_ACCESS_ERR, 7, 42)
    assert not t.done()
    t.settle(1, WcStatus.SUCCESS)
    message = (
        "REM_ACCESS_ERR: the peer rejected the access: wrong rkey, range outside its region, "
        "missing access rights, or the region was deregistered (wc status 10, vendor_err 7, qp 42)"
    )
    assert surface(t) == (13, message, False, False, False, True, True)
    err = t.error()
    assert isinstance(err, TransferFailed)
    assert (err.message, err.code, err.wc_status, err.vendor_err, err.qp_num) == (
        message,
        StatusCode.ERR_RDMA_OP,
        WcStatus.REM_ACCESS_ERR,
        7,
        42,
    )
    assert (err.peer, err.transfer_id, err.local_offsets, err.remote_offsets, err.hint) == (
        "peer-b",
        5,
        (0, 8),
        (16, 32),
        None,
    )
    with pytest.raises(TransferFailed) as caught:
        await t
    assert caught.value is err
    assert repr(t) == "<Transfer 5 RDMA_WRITE 24B to peer-b ERR_RDMA_OP>"


async def test_a_failed_completion_without_details() -> None:
    t = make()
    t.start(1)
    t.settle(1, WcStatus.RETRY_EXC_ERR)
    err = t.error()
    assert err is not None
    assert t.Message() == (
        "RETRY_EXC_ERR: the peer stopped answering (dead process, link down, or lost packets) "
        "(wc status 12, vendor_err 0)"
    )
    assert (err.vendor_err, err.qp_num, err.wc_status) == (0, None, WcStatus.RETRY_EXC_ERR)


async def test_completions_after_the_end_are_ignored() -> None:
    t = make()
    t.start(1)
    t.settle(1, WcStatus.SUCCESS)
    t.settle(5, WcStatus.REM_ACCESS_ERR)  # more than it had: ignored, not "more completions than work requests"
    assert surface(t) == (0, "", False, False, True, False, True)


async def test_successes_beyond_its_work_requests_are_a_runtime_bug_not_a_success() -> None:
    """A success count past what was posted means the accounting above is wrong: say so, end nothing."""
    t = make()
    t.start(2)
    with pytest.raises(RuntimeError, match=r"^more completions than work requests$"):
        t.settle(3, WcStatus.SUCCESS)
    assert t.InProgress()


async def test_fail_without_a_completion() -> None:
    t = make()
    t.fail(StatusCode.ERR_BAD_STATE, "the peer restarted", hint="reconnect")
    assert surface(t) == (14, "the peer restarted", False, False, False, True, True)
    err = t.error()
    assert err is not None
    assert (err.message, err.code, err.wc_status, err.vendor_err, err.qp_num, err.hint) == (
        "the peer restarted",
        StatusCode.ERR_BAD_STATE,
        None,
        0,
        None,
        "reconnect",
    )
    assert str(err) == "the peer restarted (hint: reconnect)"
    assert (err.peer, err.transfer_id, err.local_offsets, err.remote_offsets) == ("peer-b", 5, (0, 8), (16, 32))
    plain = make()
    plain.fail(StatusCode.ERR_NOT_FOUND, "gone")
    assert plain.error() is not None and plain.error().hint is None  # type: ignore[union-attr]


@pytest.mark.parametrize("code", list(StatusCode))
async def test_failed_means_a_code_above_ten(code: StatusCode) -> None:
    t = make()
    t.fail(code, "x")
    assert t.Failed() is (code > 10)
    assert t.Succeeded() is (code is StatusCode.SUCCESS)
    assert t.Code() == int(code) and type(t.Code()) is int
    assert (t.error() is None) is (code is StatusCode.SUCCESS)


async def test_the_first_terminal_state_is_latched() -> None:
    ok = make()
    ok.start(1)
    ok.settle(1, WcStatus.SUCCESS)
    ok.fail(StatusCode.ERR_BAD_STATE, "late")
    assert surface(ok) == (0, "", False, False, True, False, True) and ok.error() is None
    bad = make()
    bad.fail(StatusCode.ERR_NOT_FOUND, "first")
    err = bad.error()
    bad.fail(StatusCode.ERR_BAD_STATE, "second")
    bad.start(1)  # a start after the end changes the code again: never done by the runtime
    bad.settle(1, WcStatus.SUCCESS)
    assert bad.Message() == "first" and bad.error() is err


async def test_awaiters_all_wake_and_a_cancelled_one_does_not_stop_the_others() -> None:
    t = make()
    t.start(1)
    tasks = [asyncio.ensure_future(t.wait()) for _ in range(3)]
    await asyncio.sleep(0)
    tasks[1].cancel()
    await asyncio.sleep(0)
    t.settle(1, WcStatus.SUCCESS)
    assert await asyncio.wait_for(tasks[0], 5) is None
    assert await asyncio.wait_for(tasks[2], 5) is None
    assert tasks[1].cancelled()


async def test_a_single_awaiter_wakes_with_the_failure() -> None:
    t = make()
    task = asyncio.ensure_future(t.wait(None))
    await asyncio.sleep(0)
    t.fail(StatusCode.ERR_BAD_STATE, "gone")
    with pytest.raises(TransferFailed, match=r"^gone$"):
        await asyncio.wait_for(task, 5)


async def test_a_wait_that_times_out_leaves_the_transfer_running() -> None:
    t = make()
    t.start(1)
    loop = asyncio.get_running_loop()
    began = loop.time()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(t.wait(0.001), 5)
    assert loop.time() - began < 2  # its own deadline, not the guard's
    assert surface(t) == (2, "", False, True, False, False, False)
    t.settle(1, WcStatus.SUCCESS)
    await asyncio.wait_for(t.wait(), 5)


async def test_waits_cancelled_again_and_again_keep_a_bounded_list() -> None:
    t = make()
    t.start(1)
    live = asyncio.ensure_future(t.wait())
    lengths = []
    for _ in range(40):
        with pytest.raises(TimeoutError):
            await t.wait(0)
        lengths.append(t.attached().awaiters)
    assert max(lengths) == 16  # pruned of done waiters once 16 are held
    assert min(lengths) == 2  # the live one is kept
    t.settle(1, WcStatus.SUCCESS)
    assert await asyncio.wait_for(live, 5) is None


async def test_done_callbacks_run_once_in_order_after_the_end() -> None:
    t = make()
    log: list[tuple[str, Transfer]] = []

    def cb(name: str) -> Any:
        return lambda tr: log.append((name, tr))

    fns = {n: cb(n) for n in "abcd"}
    for n in "abc":
        t.add_done_callback(fns[n])
    t.remove_done_callback(fns["a"])
    t.add_done_callback(fns["d"])  # after b and c, although the first slot is free
    t.start(1)
    t.settle(1, WcStatus.SUCCESS)
    assert log == [("b", t), ("c", t), ("d", t)]
    t.fail(StatusCode.ERR_BAD_STATE, "late")
    assert len(log) == 3
    t.add_done_callback(fns["a"])  # already ended: at once
    assert log[-1] == ("a", t)


async def test_the_only_done_callback_runs_and_can_be_removed() -> None:
    log: list[str] = []
    t = make()
    t.add_done_callback(lambda _t: log.append("only"))
    assert t.attached() == (0, 0, 1, 0)  # one callback (the router's) takes a slot, not a list: no object per transfer
    t.fail(StatusCode.ERR_BAD_STATE, "x")
    assert log == ["only"]
    u = make()

    def fn(_t: Transfer) -> None:
        log.append("removed")

    u.add_done_callback(fn)
    u.remove_done_callback(fn)
    u.fail(StatusCode.ERR_BAD_STATE, "x")
    assert log == ["only"]


async def test_attached_counts_every_done_callback_and_one_list_for_the_later_ones() -> None:
    t = make()
    assert t.attached() == (0, 0, 0, 0)
    callbacks = [lambda _t: None for _ in range(3)]
    for n, fn in enumerate(callbacks, 1):
        t.add_done_callback(fn)
        assert t.attached() == (0, 0, n, 0 if n == 1 else 1)  # the first takes the slot, the others one list
    t.remove_done_callback(callbacks[0])
    assert t.attached() == (0, 0, 2, 1)
    t.fail(StatusCode.ERR_BAD_STATE, "x")
    assert t.attached() == (0, 0, 0, 0)  # an ended transfer holds nothing for others


async def test_removing_a_later_callback_keeps_the_first() -> None:
    log: list[str] = []
    t = make()

    def first(_t: Transfer) -> None:
        log.append("first")

    def second(_t: Transfer) -> None:
        log.append("second")

    def third(_t: Transfer) -> None:
        log.append("third")

    t.add_done_callback(first)
    t.add_done_callback(second)
    t.add_done_callback(third)
    t.remove_done_callback(second)
    t.remove_done_callback(lambda _t: None)  # never added: nothing happens
    t.fail(StatusCode.ERR_BAD_STATE, "x")
    assert log == ["first", "third"]
    u = make()
    u.remove_done_callback(first)  # nothing registered at all
    u.add_done_callback(first)
    u.remove_done_callback(second)  # not the first, no others
    u.fail(StatusCode.ERR_BAD_STATE, "x")
    assert log == ["first", "third", "first"]


async def test_callbacks_run_before_watchers_and_first_before_the_rest() -> None:
    log: list[Any] = []
    t = make()
    t.watch(Watch(log, "w1"))
    t.add_done_callback(lambda _t: log.append("cb1"))
    t.add_done_callback(lambda _t: log.append("cb2"))
    t.watch(Watch(log, "w2"))
    t.fail(StatusCode.ERR_BAD_STATE, "x")
    assert log == ["cb1", "cb2", "w1", "w2"]


async def test_watchers_are_told_once_unless_closed() -> None:
    t = make()
    told, closed = Watch(), Watch()
    t.watch(told)
    t.watch(closed)
    closed.closed = True
    t.start(1)
    t.settle(1, WcStatus.SUCCESS)
    assert told.seen == [t] and closed.seen == []
    t.fail(StatusCode.ERR_BAD_STATE, "late")
    assert told.seen == [t]
    late = Watch()
    t.watch(late)  # already ended: at once
    assert late.seen == [t]
    only = Watch()
    u = make()
    u.watch(only)
    u.fail(StatusCode.ERR_BAD_STATE, "x")
    assert only.seen == [u]


async def test_closed_watchers_are_dropped_once_sixteen_are_held() -> None:
    t = make()
    live = Watch()
    t.watch(live)
    lengths = []
    for _ in range(40):
        w = Watch()
        t.watch(w)
        w.closed = True
        lengths.append(t.attached().watchers)
    assert max(lengths) == 16
    assert min(lengths) == 2  # the live one survives every pruning
    t.fail(StatusCode.ERR_BAD_STATE, "x")
    assert live.seen == [t]
