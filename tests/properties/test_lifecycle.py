"""Nothing is lost, and cancelling a waiter cancels nothing else."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Awaitable, Callable

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from moriio_async import (
    InvalidArgument,
    MemoryInUse,
    Transfer,
    TransferError,
    TransferFailed,
    WcStatus,
    waiting_for_transfer_complete,
)

from .clock import VirtualClock
from .conftest import needs_held_mock
from .model import (
    ERRORS,
    NicStep,
    held_pair,
    held_qp,
    nic_steps,
    observed,
    post_batch,
    requests_per_transfer,
    run_until_done,
    settle,
)

pytestmark = needs_held_mock


@given(
    requests_per_transfer,
    st.integers(1, 8),
    st.lists(st.tuples(nic_steps, st.integers(0, 2)), max_size=8),
    st.booleans(),
)
async def test_every_transfer_ends_exactly_once_and_abort_leaves_nothing_held(
    wrs: list[int], depth: int, script: list[tuple[NicStep, int]], silent: bool
) -> None:
    """Every posted transfer ends exactly once; after abort and its flush, the runtime holds no
    transfer, no send-queue slot (in flight or waiting) and no pinned memory for that session, and
    the session works again on a fresh queue pair."""
    async with held_pair(silent=silent, sq_depth=depth) as p:
        ts = post_batch(p.session, wrs)
        ends: Counter[int] = Counter()
        for t in ts:
            t.add_done_callback(lambda t: ends.update([t.id]))
        qp = held_qp(p.session)
        for step, rounds in script:
            step.apply(qp)
            await settle(rounds)
        if not all(t.done() for t in ts):
            with pytest.raises(MemoryInUse):
                p.a.deregister_memory(p.desc_a)  # refused while the NIC may still touch the buffer
        await p.session.abort()
        assert all(t.done() for t in ts)
        assert ends == Counter(t.id for t in ts), "a transfer ended twice, or never"
        stats = p.session.statistics()
        assert stats.in_flight == 0 and stats.waiting == 0
        assert p.a.outstanding == 0
        # The session is usable again. (If the peer vanished while the pair was idle, nothing told the
        # runtime, abort had nothing to do, and the next transfer is the one that finds out; the one
        # after it runs on a new queue pair.)
        again = p.session.read(0, 0, 8)
        await run_until_done(p, [again])
        if not again.Succeeded():
            assert again.error() is not None and again.error().wc_status is WcStatus.WR_FLUSH_ERR
            again = p.session.read(0, 0, 8)
            await run_until_done(p, [again])
        assert again.Succeeded()
        assert ends == Counter(t.id for t in ts)
        p.a.deregister_memory(p.desc_a)  # no pins left: must not raise


@given(requests_per_transfer, st.lists(nic_steps, max_size=4), st.booleans(), st.booleans())
async def test_a_timed_out_transfer_keeps_its_buffers_pinned_until_it_ends(
    wrs: list[int], before: list[NicStep], silent: bool, fail_fast: bool
) -> None:
    """A transfer a wait called timed out has not ended: it stays counted and its buffers stay pinned,
    so deregister_memory refuses with MemoryInUse and release_memory waits, until the last such
    transfer ends; then release_memory deregisters the buffer."""
    loop = asyncio.get_running_loop()
    async with held_pair(silent=silent, sq_depth=sum(wrs)) as p:
        ts = post_batch(p.session, wrs)
        qp = held_qp(p.session)
        for step in before:
            step.apply(qp)
        with VirtualClock(loop) as clock:
            try:
                await waiting_for_transfer_complete(ts, timeout=5 if clock.virtual else 0.02, fail_fast=fail_fast)
            except TransferError as exc:
                timed_out = [e.transfer_id for e in exc.timed_out]
            else:
                timed_out = []
            pending = [t for t in ts if not t.done()]
            # (A fail_fast wait that ended at a failure calls nothing timed out; the rest run all the same.)
            assert timed_out == [t.id for t in pending] or (fail_fast and not timed_out)
            assert p.a.outstanding == len(pending)
            if not pending:
                return
            with pytest.raises(MemoryInUse):
                p.a.deregister_memory(p.desc_a)
            release = loop.create_task(p.a.release_memory(p.desc_a))
            await settle()
            # Everything but the last request runs: the last timed-out transfer still holds the buffer.
            qp.step(qp.held - 1)
            with contextlib.suppress(TransferError):
                await waiting_for_transfer_complete(ts, timeout=0.01)  # drains a silent queue too
            assert [t for t in ts if not t.done()] == pending[-1:]
            assert not release.done(), "release_memory returned while a timed-out transfer still ran"
            with pytest.raises(MemoryInUse):
                p.a.deregister_memory(p.desc_a)
            qp.step(1)
            with contextlib.suppress(TransferError):
                await waiting_for_transfer_complete(ts, timeout=0.01)
            assert all(t.done() for t in ts) and p.a.outstanding == 0
            await asyncio.wait_for(release, 5)
        with pytest.raises(InvalidArgument):
            p.a.deregister_memory(p.desc_a)  # release_memory deregistered it


def _cancel_task(aw: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
    async def run() -> None:
        task = asyncio.get_running_loop().create_task(_call(aw))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    return run


async def _call(aw: Callable[[], Awaitable[None]]) -> None:
    await aw()


def _asyncio_timeout(aw: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
    async def run() -> None:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.01):
                await aw()

    return run


def _wait_for(aw: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
    async def run() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(_call(aw), 0.01)

    return run


def _anyio_move_on(aw: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
    async def run() -> None:
        with anyio.move_on_after(0.01) as scope:
            await aw()
        assert scope.cancelled_caught

    return run


def _anyio_scope_cancel(aw: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
    async def run() -> None:
        with anyio.CancelScope() as scope:
            asyncio.get_running_loop().call_later(0.01, scope.cancel)
            await aw()
        assert scope.cancelled_caught

    return run


CANCELLERS = {
    "task.cancel": _cancel_task,
    "asyncio.timeout": _asyncio_timeout,
    "asyncio.wait_for": _wait_for,
    "anyio.move_on_after": _anyio_move_on,
    "anyio.CancelScope.cancel": _anyio_scope_cancel,
}


def _awaiting(how: str, ts: list[Transfer]) -> Callable[[], Awaitable[None]]:
    if how == "await":

        async def aw() -> None:
            await ts[0]
    elif how == "wait":

        async def aw() -> None:
            await ts[0].wait()
    else:

        async def aw() -> None:
            await waiting_for_transfer_complete(ts)

    return aw


@given(
    st.sampled_from(sorted(CANCELLERS)),
    st.sampled_from(["await", "wait", "waiting_for_transfer_complete"]),
    st.integers(1, 3),
    st.integers(0, 3),
    st.one_of(st.none(), st.sampled_from(ERRORS)),
)
async def test_cancelling_the_waiter_leaves_the_transfer_running_and_accounted(
    canceller: str, how: str, n: int, ran_before: int, failure: WcStatus | None
) -> None:
    """Cancelling the task that awaits a transfer (task.cancel, asyncio.timeout, wait_for, anyio cancel
    scopes) stops the waiting only: the transfer keeps running, stays counted and pinned, and waiting
    again later gives its real outcome."""
    async with held_pair() as p:
        ts = post_batch(p.session, [1] * n)
        qp = held_qp(p.session)
        ran_before = min(ran_before, n - 1)  # the first transfer is still running when cancelled
        with VirtualClock(asyncio.get_running_loop()):
            qp.step(ran_before) if ts[0].done() else None
            await CANCELLERS[canceller](_awaiting(how, ts))()
        assert not ts[0].done() and ts[0].InProgress()
        assert p.a.outstanding == sum(not t.done() for t in ts)
        with pytest.raises(MemoryInUse):
            p.a.deregister_memory(p.desc_a)
        if failure is not None:
            qp.fail_next(failure)
        qp.step(n)
        if failure is None:
            await waiting_for_transfer_complete(ts, timeout=5)
            assert all(t.Succeeded() for t in ts)
        else:
            with pytest.raises(TransferFailed) as info:
                await ts[0]
            assert info.value.wc_status is failure
            with pytest.raises(TransferError) as group:
                await waiting_for_transfer_complete(ts, timeout=5)
            assert [observed(t) for t in ts] == [failure] + [WcStatus.WR_FLUSH_ERR] * (n - 1)
            assert len(group.value.failed) == n
        assert p.a.outstanding == 0
