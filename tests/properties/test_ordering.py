"""Ordering on one queue pair, flushes after a failure, and notifications after writes."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from moriio_async import Transfer, WcStatus, waiting_for_transfer_complete

from .conftest import backends, needs_held_mock
from .model import (
    HeldModel,
    NicStep,
    engine_pair,
    held_pair,
    held_qp,
    nic_steps,
    observed,
    post_batch,
    requests_per_transfer,
    run_until_done,
    settle,
)


@needs_held_mock
@given(
    requests_per_transfer,
    st.lists(st.tuples(nic_steps, st.integers(0, 3)), max_size=10),
    st.integers(1, 24),
)
async def test_completions_on_one_queue_pair_are_delivered_in_posting_order(
    wrs: list[int], script: list[tuple[NicStep, int]], depth: int
) -> None:
    """On one queue pair, transfers end in the order they were posted, each with what the NIC said
    about its requests, however the completions are batched; and after the first failure every later
    transfer on that pair fails with a flush error (WR_FLUSH_ERR), never a success."""
    async with held_pair(sq_depth=depth) as p:
        ts = post_batch(p.session, wrs)
        ended: list[int] = []
        for t in ts:
            t.add_done_callback(lambda t: ended.append(t.id))
        qp = held_qp(p.session)
        model = HeldModel(wrs)
        for step, rounds in script:
            step.apply(qp)
            model.apply(step)
            await settle(rounds)
        # Then the NIC runs whatever is left (and whatever the runtime posts as slots free up).
        await run_until_done(p, ts)
        assert ended == [t.id for t in ts]
        statuses = [observed(t) for t in ts]
        if depth >= sum(wrs):
            # Everything was posted at once, so the model knows what each completion said.
            model.apply(NicStep("run", sum(wrs)))
            assert statuses == [model.outcome(i) for i in range(len(ts))]
        bad = [i for i, s in enumerate(statuses) if s is not WcStatus.SUCCESS]
        if bad:
            assert all(s is WcStatus.WR_FLUSH_ERR for s in statuses[bad[0] + 1 :]), statuses


@given(
    st.lists(
        st.lists(st.tuples(st.integers(0, 255), st.integers(0, 191), st.integers(1, 64)), min_size=1, max_size=6),
        min_size=1,
        max_size=4,
    )
)
@backends()
async def test_writes_completed_before_a_notification_are_visible_when_it_arrives(
    backend: str, rounds: list[list[tuple[int, int, int]]]
) -> None:
    """Writes that completed before a notification was sent are visible in the peer's memory when the
    peer receives that notification."""
    block = 4096
    async with engine_pair(backend) as p:
        expected = p.buf_b.copy()
        for n, writes in enumerate(rounds):
            ts: list[Transfer] = []
            for value, slot, blocks in writes:
                lo = slot * block
                size = blocks * block
                p.buf_a[lo : lo + size] = value
                ts.append(p.session.write(lo, lo, size))
                expected[lo : lo + size] = value
                await waiting_for_transfer_complete(ts[-1:], timeout=30)
                # The local buffer may be reused at once: the data is the peer's now.
                p.buf_a[lo : lo + size] = 0xFF - value
            await p.a.notify("b", f"write_done {n}".encode())
            note = await p.b.recv_notification(timeout=30)
            assert note.data == f"write_done {n}".encode()
            assert np.array_equal(p.buf_b, expected)
