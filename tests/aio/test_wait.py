"""The deadline wait and the transfer's own semantics, on the mock backend where the test drives the NIC."""

from __future__ import annotations

import asyncio
import contextlib

import anyio
import pytest

from moriio_async import (
    MockOptions,
    StatusCode,
    TransferError,
    TransferFailed,
    WcStatus,
    waiting_for_transfer_complete,
)
from moriio_async.aio.transfer import Transfer
from moriio_async.backends.mock import MockQueuePair
from moriio_async.status import Opcode

from ..engine.conftest import Pair, make_pair


def nic(p: Pair) -> MockQueuePair:
    qp = p.session.channel.qp
    assert isinstance(qp, MockQueuePair)
    return qp


async def test_wait_returns_once_all_succeeded(held: Pair) -> None:
    ts = [held.session.read(i, i, 1) for i in range(5)]
    assert all(t.InProgress() for t in ts)
    asyncio.get_running_loop().call_soon(nic(held).step, 5)
    await waiting_for_transfer_complete(ts, timeout=5)
    assert all(t.Succeeded() for t in ts)


async def test_timeout_lists_every_pending_transfer_and_they_go_on(held: Pair) -> None:
    ts = [held.session.read(i, i, 1) for i in range(4)]
    nic(held).step(1)
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(TransferError) as info:
        await waiting_for_transfer_complete(ts, timeout=0.2)
    elapsed = loop.time() - start
    assert 0.2 - 1e-6 <= elapsed < 0.2 + 1.0  # loop time; the tolerance is float rounding only
    assert info.value.failed == []
    assert sorted(e.transfer_id for e in info.value.timed_out) == [t.id for t in ts[1:]]
    assert [e.timeout for e in info.value.timed_out] == [0.2] * 3  # each says the deadline it missed
    assert str(info.value).startswith("3/4 transfers failed:")
    assert "adjust" not in str(info.value)  # hint lives on the member, not in every line
    # A timeout is not a cancellation: the transfers are still held, pinned, and end later.
    assert held.a.outstanding == 3
    nic(held).step(3)
    await waiting_for_transfer_complete(ts, timeout=5)
    assert held.a.outstanding == 0


async def test_completions_sitting_in_the_cq_are_not_called_timeouts() -> None:
    a, b, p = await make_pair("mock", mock=MockOptions(silent_cq=True))
    try:
        ts = [p.session.read(i, i, 1) for i in range(3)]
        # The NIC finished them all, but no channel event was raised.
        assert not any(t.done() for t in ts)
        await waiting_for_transfer_complete(ts, timeout=0.05)
        assert all(t.Succeeded() for t in ts)
    finally:
        await a.close()
        await b.close()


async def test_the_final_drain_covers_every_engine_behind_the_wait() -> None:
    """Transfers of two engines in one wait, each engine's completions in its CQ and never notified: at the
    deadline both completion queues are drained, not only the first transfer's engine."""
    pairs = [await make_pair("mock", mock=MockOptions(silent_cq=True)) for _ in range(2)]
    try:
        ts = [p.session.read(i, i, 1) for _, _, p in pairs for i in range(3)]
        ts.append(pairs[0][2].session.read(9, 9, 1))  # the first engine's again, after the second's
        assert not any(t.done() for t in ts)
        await waiting_for_transfer_complete(ts, timeout=0.05)
        assert all(t.Succeeded() for t in ts)
    finally:
        for a, b, _ in pairs:
            await a.close()
            await b.close()


async def test_failed_and_pending_are_accounted_exactly(held: Pair) -> None:
    ok = held.session.read(0, 0, 1)
    nic(held).step(1)
    await ok
    bad = held.session.read(0, 0, 1)
    nic(held).fail_next(WcStatus.REM_ACCESS_ERR)
    nic(held).step(1)
    later = held.session.read(0, 0, 1)  # posted after the failure: must be flushed, never succeed
    with pytest.raises(TransferError) as info:
        await waiting_for_transfer_complete([ok, bad, later], timeout=0.2)
    failed = {e.transfer_id: e for e in info.value.failed}
    assert set(failed) == {bad.id, later.id}
    assert failed[bad.id].wc_status is WcStatus.REM_ACCESS_ERR
    assert failed[later.id].wc_status is WcStatus.WR_FLUSH_ERR or failed[later.id].code is StatusCode.ERR_RDMA_OP
    assert info.value.timed_out == []
    assert ok.Succeeded()


async def test_fail_fast_raises_at_the_first_failure(held: Pair) -> None:
    ts = [held.session.read(i, i, 1) for i in range(3)]
    qp = nic(held)
    loop = asyncio.get_running_loop()

    def fail_first() -> None:
        qp.fail_next(WcStatus.REM_ACCESS_ERR)
        qp.step(1)

    loop.call_later(0.01, fail_first)
    start = loop.time()
    with pytest.raises(TransferError) as info:
        await waiting_for_transfer_complete(ts, timeout=30, fail_fast=True)
    assert loop.time() - start < 5
    assert next(e.transfer_id for e in info.value.failed) == ts[0].id
    assert info.value.timed_out == []


async def test_first_terminal_state_is_latched(held: Pair) -> None:
    t = held.session.read(0, 0, 1)
    nic(held).step(1)
    await t
    t.fail(StatusCode.ERR_BAD_STATE, "late failure")
    t.settle(1, WcStatus.REM_ACCESS_ERR)
    assert t.Succeeded() and t.Code() == 0 and t.Message() == ""
    await t


async def test_cancelling_the_waiter_does_not_cancel_the_transfer(held: Pair) -> None:
    t = held.session.read(0, 0, 1)
    waiter = asyncio.get_running_loop().create_task(t.wait())
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert t.InProgress() and held.a.outstanding == 1
    nic(held).step(1)
    await t
    assert t.Succeeded()


async def test_anyio_cancel_scope_leaves_the_transfer_running(held: Pair) -> None:
    t = held.session.read(0, 0, 1)
    with anyio.move_on_after(0.01) as scope:
        await t
    assert scope.cancelled_caught
    assert t.InProgress()
    nic(held).step(1)
    await t
    assert t.Succeeded()


async def test_awaiting_a_failed_transfer_raises_transfer_failed(held: Pair) -> None:
    t = held.session.read(0, 0, 1)
    nic(held).fail_next(WcStatus.REM_ACCESS_ERR)
    nic(held).step(1)
    with pytest.raises(TransferFailed) as info:
        await t
    err = info.value
    assert err.peer == "b" and err.local_offsets == (0,) and err.remote_offsets == (0,)
    assert err.qp_num == held.session.statistics().qp_num


async def test_peer_vanishing_fails_oldest_with_retry_exceeded_then_flushes(held: Pair) -> None:
    ts = [held.session.read(i, i, 1) for i in range(4)]
    nic(held).vanish()
    with pytest.raises(TransferError) as info:
        await waiting_for_transfer_complete(ts, timeout=5)
    statuses = [e.wc_status for e in sorted(info.value.failed, key=lambda e: e.transfer_id)]
    assert statuses == [WcStatus.RETRY_EXC_ERR] + [WcStatus.WR_FLUSH_ERR] * 3


async def test_empty_wait_returns_at_once() -> None:
    await waiting_for_transfer_complete([], timeout=0)


async def test_the_deadline_drains_each_engine_once_however_many_transfers_wait(held: Pair) -> None:
    """The dedup keyed on the id of a bound method made per transfer: one drain per pending transfer."""
    ts = [held.session.read(i, i, 1) for i in range(50)]
    before = held.a.statistics().router.drains
    with pytest.raises(TransferError) as info:
        await waiting_for_transfer_complete(ts, timeout=0.01)
    assert len(info.value.timed_out) == 50
    assert held.a.statistics().router.drains == before + 1
    nic(held).step(50)
    await waiting_for_transfer_complete(ts, timeout=5)


@pytest.mark.parametrize("fail_fast", [False, True])
@pytest.mark.parametrize("failure", ["none", "in the cq", "known"])
async def test_timeout_zero_with_transfers_pending_raises_at_once(held: Pair, failure: str, fail_fast: bool) -> None:
    """timeout=0 is a deadline that has already passed, not "no deadline": with transfers pending the
    wait raises at once with every pending transfer timed out, and those go on. A failure still in the
    completion queue is found by the wait's drain and listed as what it is; a fail_fast wait that knew
    of a failure before it began lists that failure only."""
    ts = [held.session.read(i, i, 1) for i in range(5)]
    qp = nic(held)
    qp.step(1)
    if failure != "none":
        qp.fail_next(WcStatus.REM_ACCESS_ERR)
        qp.step(1)  # the rest stay held: pending, on a pair now in error
    if failure == "known":
        with pytest.raises(TransferFailed):
            await ts[1]
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(TransferError) as info:
        async with asyncio.timeout(5):  # a wait that took 0 for "no deadline" would hang here
            await waiting_for_transfer_complete(ts, timeout=0, fail_fast=fail_fast)
    assert loop.time() - start < 1.0
    pending = ts[1:] if failure == "none" else ts[2:]
    assert ts[0].Succeeded()
    assert [e.transfer_id for e in info.value.failed] == ([] if failure == "none" else [ts[1].id])
    timed_out = [] if failure == "known" and fail_fast else [t.id for t in pending]
    assert [e.transfer_id for e in info.value.timed_out] == timed_out
    assert all(e.timeout == 0 for e in info.value.timed_out)
    assert info.value.total == 5
    assert held.a.outstanding == len(pending)
    qp.step(len(pending))
    with pytest.raises(TransferError) if failure != "none" else contextlib.nullcontext():
        await waiting_for_transfer_complete(ts, timeout=5)
    assert held.a.outstanding == 0


async def test_a_transfer_given_twice_is_listed_once(held: Pair) -> None:
    """The same transfer passed to waiting_for_transfer_complete more than once is one transfer: it is
    listed once in the error, and the total counts distinct transfers."""
    ok, bad, slow, idle = (held.session.read(i, i, 1) for i in range(4))
    qp = nic(held)
    qp.step(1)
    qp.fail_next(WcStatus.REM_ACCESS_ERR)
    qp.step(1)  # slow and idle stay held
    with pytest.raises(TransferError) as info:
        await waiting_for_transfer_complete([bad, slow, ok, bad, slow, bad, idle, ok], timeout=0.05)
    err = info.value
    assert [e.transfer_id for e in err.failed] == [bad.id]
    assert [e.transfer_id for e in err.timed_out] == [slow.id, idle.id]
    assert err.total == 4
    assert str(err).startswith("3/4 transfers failed:")
    assert len(str(err).splitlines()) == 1 + 3


async def test_a_timeout_lists_what_was_pending_at_the_deadline_even_if_read_after_it_ended(held: Pair) -> None:
    """The error's members are made when first read; what they list was decided at the deadline."""
    ts = [held.session.read(i, i, 1) for i in range(3)]
    nic(held).step(1)
    with pytest.raises(TransferError) as info:
        await waiting_for_transfer_complete(ts, timeout=0.05)
    nic(held).step(2)
    await waiting_for_transfer_complete(ts, timeout=5)
    assert all(t.Succeeded() for t in ts)
    assert [e.transfer_id for e in info.value.timed_out] == [t.id for t in ts[1:]]
    assert str(info.value).startswith("2/3 transfers failed:")


async def test_failures_are_listed_by_transfer_id_whenever_they_were_seen(held: Pair) -> None:
    """A failure known before the wait and one seen during it are listed in transfer-id order, not in
    the order they were found."""
    first, second, idle = (held.session.read(i, i, 1) for i in range(3))
    second.fail(StatusCode.ERR_BAD_STATE, "known before the wait")
    asyncio.get_running_loop().call_soon(first.fail, StatusCode.ERR_BAD_STATE, "seen during the wait")
    with pytest.raises(TransferError) as info:
        await waiting_for_transfer_complete([first, second, idle], timeout=0.05)
    assert [e.transfer_id for e in info.value.failed] == [first.id, second.id]
    assert [e.transfer_id for e in info.value.timed_out] == [idle.id]
    nic(held).step(3)
    await waiting_for_transfer_complete(idle, timeout=5)


class StoppedClock(asyncio.SelectorEventLoop):
    """An asyncio loop whose time moves only when the test sets it."""

    now = 0.0

    def time(self) -> float:
        return self.now


def test_the_wait_ends_at_its_deadline_exactly_on_a_clock_only_the_test_moves() -> None:
    """The deadline is reached when the loop's time equals it: the wait ends then, and not before (a
    wait that looked again while no time passed would never end on such a clock)."""
    loop = StoppedClock()
    drained: list[int] = []

    class Drain:
        def drain(self) -> int:
            drained.append(1)
            return 0

    async def main() -> None:
        t = Transfer(loop, 7, Opcode.RDMA_READ, "b", (0,), (0,), (8,), drainer=Drain())
        t.start(1)
        waiting = loop.create_task(waiting_for_transfer_complete([t], timeout=5))
        for now in (0.0, 4.0, 5.0 - 1e-9):
            loop.now = now
            for _ in range(5):
                await asyncio.sleep(0)
            assert not waiting.done(), now
        loop.now = 5.0
        for _ in range(5):
            await asyncio.sleep(0)
        assert waiting.done()
        with pytest.raises(TransferError) as info:
            await waiting
        assert [e.transfer_id for e in info.value.timed_out] == [7] and drained == [1]

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


async def test_waiting_again_and_again_on_a_transfer_that_never_ends_holds_a_bounded_list() -> None:
    """Each wait that ended leaves its watcher closed on the transfer, and closed watchers are dropped as
    new ones come: a thousand waits that time out hold no more than a handful."""
    t = Transfer(asyncio.get_running_loop(), 7, Opcode.RDMA_READ, "b", (0,), (0,), (8,))
    t.start(1)
    for _ in range(1000):
        with pytest.raises(TransferError):
            await waiting_for_transfer_complete(t, timeout=0)
    assert t.attached().watchers <= 17
