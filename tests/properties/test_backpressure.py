"""Backpressure: a full send queue makes transfers wait, never fail."""

from __future__ import annotations

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from moriio_async import WcStatus, waiting_for_transfer_complete

from .conftest import backends, needs_held_mock, slow_examples
from .model import engine_pair, held_pair, held_qp, observed, post_batch, settle


@needs_held_mock
@given(
    st.integers(1, 8),
    st.lists(st.integers(1, 3), min_size=2, max_size=12),
    st.lists(st.tuples(st.integers(1, 6), st.integers(0, 2)), min_size=1, max_size=30),
)
async def test_more_transfers_than_slots_wait_for_room_and_never_fail_for_it(
    depth: int, wrs: list[int], script: list[tuple[int, int]]
) -> None:
    """With send-queue depth d and more requests than d posted at once, none fails for lack of room,
    they complete in posting order, and at no time are more than d requests on the queue pair."""
    assume(sum(wrs) > depth)
    async with held_pair(sq_depth=depth) as p:
        ts = post_batch(p.session, wrs)  # must not raise: the runtime queues what does not fit
        ended: list[int] = []
        for t in ts:
            t.add_done_callback(lambda t: ended.append(t.id))
        qp = held_qp(p.session)
        highest = qp.held

        def step(n: int) -> None:
            nonlocal highest
            qp.step(n)
            highest = max(highest, qp.held)

        for n, rounds in script:
            step(n)
            await settle(rounds)
            highest = max(highest, qp.held)
        for _ in range(10 * sum(wrs)):
            if all(t.done() for t in ts):
                break
            step(depth)
            await settle(1)
            highest = max(highest, qp.held)
        assert highest <= depth
        assert [observed(t) for t in ts] == [WcStatus.SUCCESS] * len(ts)
        assert ended == [t.id for t in ts]
        assert p.session.statistics().max_in_flight <= depth


@settings(max_examples=slow_examples(5))
@given(st.integers(1, 8), st.integers(20, 120), st.sampled_from([1, 3]))
@backends()
async def test_backpressure_on_a_real_backend(backend: str, depth: int, n: int, blocks: int) -> None:
    """The same on a real NIC: n > d transfers posted at once all succeed, in posting order, with at
    most d requests in flight (the backend itself refuses a post past its depth)."""
    async with engine_pair(backend, sq_depth=depth) as p:
        size = 512
        ts = []
        for i in range(n):
            offs = [(i * blocks + j) * 2 * size for j in range(blocks)]
            ts.append(p.session.batch_write(offs, offs, [size] * blocks))
        ended: list[int] = []
        for t in ts:
            t.add_done_callback(lambda t: ended.append(t.id))
        await waiting_for_transfer_complete(ts, timeout=60)
        assert ended == [t.id for t in ts]
        assert p.session.statistics().max_in_flight <= depth
        assert (p.buf_b[: n * blocks * 2 * size].reshape(-1, 2 * size)[:, :size] == p.buf_a[0]).all()
