"""qp_per_transfer and post_batch_size: one batch striped over several queue pairs, and its status."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from moriio_async import WcStatus
from moriio_async.compat.mori import IOEngine, IOEngineSession, RdmaBackendConfig, StatusCode, TransferStatus
from moriio_async.compat.mori.plan import plan_parts

from .conftest import make_pair, on_loop, register
from .test_inbound import wait_inbound


def held_counts(engine: IOEngine, session: IOEngineSession) -> list[int]:
    return on_loop(engine, lambda: [s.channel.qp.held for s in session.stripes])


def step(engine: IOEngine, session: IOEngineSession, stripe: int, n: int = 1 << 20) -> None:
    on_loop(engine, session.stripes[stripe].channel.qp.step, n)


def outstanding(engine: IOEngine) -> int:
    return engine.aio.outstanding


def scattered(n: int) -> tuple[list[int], list[int], list[int]]:
    """n blocks of 256 B, contiguous nowhere (every other slot on both sides)."""
    offsets = [i * 512 for i in range(n)]
    return offsets, offsets, [256] * n


def test_plan_merges_sorts_and_rotates() -> None:
    # contiguous on both sides -> one request; sorted by remote offset first
    assert [
        (p.stripe, p.sizes) for p in plan_parts([256, 0], [256, 0], [256, 256], stripes=2, post_batch_size=-1, uid=0)
    ] == [(0, [512])]
    lo, ro, sz = scattered(8)
    parts = plan_parts(lo, ro[::-1], sz, stripes=2, post_batch_size=-1, uid=0)
    assert [(p.stripe, len(p.sizes)) for p in parts] == [(0, 4), (1, 4)]
    assert parts[0].remote_offsets == sorted(ro)[:4] and parts[0].local_offsets == lo[::-1][:4]
    assert [p.stripe for p in plan_parts(lo, ro, sz, stripes=2, post_batch_size=-1, uid=1)] == [1, 0]
    assert [p.stripe for p in plan_parts(lo, ro, sz, stripes=3, post_batch_size=2, uid=0)] == [0, 1, 2, 0]
    assert [len(p.sizes) for p in plan_parts(lo, ro, sz, stripes=1, post_batch_size=0, uid=0)] == [1] * 8
    assert plan_parts([0, 8], [0, 8], [0, 0], stripes=2, post_batch_size=-1, uid=0) == []


def test_plan_merges_only_blocks_contiguous_on_both_sides() -> None:
    # remote contiguous, local not (and the reverse): two requests, each as given
    for lo, ro in (([0, 512], [0, 256]), ([0, 256], [0, 512])):
        parts = plan_parts(lo, ro, [256, 256], stripes=1, post_batch_size=-1, uid=0)
        assert [(p.local_offsets, p.remote_offsets, p.sizes) for p in parts] == [(lo, ro, [256, 256])]
    # a run of three contiguous blocks is one request, the next gap starts another
    parts = plan_parts(
        [0, 100, 200, 1000], [0, 100, 200, 1000], [100, 100, 100, 8], stripes=1, post_batch_size=-1, uid=0
    )
    assert [(p.local_offsets, p.sizes) for p in parts] == [([0, 1000], [300, 8])]


def test_plan_rounds_posts_per_stripe_up_and_rotates_by_uid_over_every_stripe() -> None:
    lo, ro, sz = scattered(7)
    assert [len(p.sizes) for p in plan_parts(lo, ro, sz, stripes=2, post_batch_size=-1, uid=0)] == [4, 3]
    assert [p.stripe for p in plan_parts(lo, ro, sz, stripes=3, post_batch_size=-1, uid=1)] == [1, 2, 0]
    assert [p.stripe for p in plan_parts(lo, ro, sz, stripes=3, post_batch_size=-1, uid=5)] == [2, 0, 1]


def test_plan_refuses_lists_of_different_lengths_instead_of_dropping_blocks() -> None:
    with pytest.raises(ValueError, match="zip"):
        plan_parts([0, 512], [0, 512], [256], stripes=1, post_batch_size=-1, uid=0)


def test_a_striped_status_ends_when_every_stripe_has(held: tuple[IOEngine, IOEngine]) -> None:
    a, b = held
    x, mx = register(a, 8192)
    y, my = register(b, 8192, fill=0)
    session = a.create_session(mx, my)
    assert session is not None and len(session.stripes) == 2
    lo, ro, sz = scattered(8)
    status = session.batch_write(lo, ro, sz, 0)
    assert status.WaitFor(20) is StatusCode.IN_PROGRESS
    assert held_counts(a, session) == [4, 4]
    step(a, session, 1)
    assert status.WaitFor(100) is StatusCode.IN_PROGRESS  # half the batch is not enough
    step(a, session, 0)
    assert status.WaitFor(5000) is StatusCode.SUCCESS
    assert all(np.array_equal(x[o : o + 256], y[o : o + 256]) for o in lo)
    # uid rotates the first post: a one-request transfer with uid 1 goes to the second queue pair
    single = session.write(0, 0, 16, 1)
    assert single.WaitFor(20) is StatusCode.IN_PROGRESS and held_counts(a, session) == [0, 1]
    step(a, session, 1)
    assert single.WaitFor(5000) is StatusCode.SUCCESS


def stripe_one_failed(held: tuple[IOEngine, IOEngine], batch: str, uid: int) -> tuple[IOEngineSession, TransferStatus]:
    """A batch over two stripes whose stripe 1 failed REM_ACCESS_ERR while stripe 0 still holds its requests."""
    a, b = held
    _, mx = register(a, 8192)
    _, my = register(b, 8192)
    session = a.create_session(mx, my)
    assert session is not None
    lo, ro, sz = scattered(8)
    status = getattr(session, batch)(lo, ro, sz, uid)
    assert status.WaitFor(20) is StatusCode.IN_PROGRESS
    on_loop(a, session.stripes[1].channel.qp.fail_next, WcStatus.REM_ACCESS_ERR)
    step(a, session, 1)
    # the failed stripe has ended, the other still holds its requests: no verdict yet
    assert status.WaitFor(100) is StatusCode.IN_PROGRESS
    return session, status


def test_first_failure_wins_after_all_stripes_end(held: tuple[IOEngine, IOEngine]) -> None:
    a, b = held
    session, status = stripe_one_failed(held, "batch_write", 33)
    step(a, session, 0)
    assert status.WaitFor(5000) is StatusCode.ERR_RDMA_OP
    assert "REM_ACCESS_ERR" in status.Message()
    inbound = wait_inbound(b, a.key, 33)  # the target hears of the failure (MoRI-IO's never does)
    assert inbound is not None and inbound.Code() is StatusCode.ERR_RDMA_OP


def test_when_every_stripe_fails_the_status_carries_the_first_failure_in_completion_order(
    held: tuple[IOEngine, IOEngine],
) -> None:
    session, status = stripe_one_failed(held, "batch_read", 34)  # stripe 1 fails first
    on_loop(held[0], session.stripes[0].channel.qp.vanish)  # then stripe 0, with another status
    assert status.WaitFor(5000) is StatusCode.ERR_RDMA_OP
    assert "REM_ACCESS_ERR" in status.Message() and "RETRY_EXC_ERR" not in status.Message(), status.Message()


def test_post_batch_size_chunks_posting() -> None:
    for post_batch_size, posts in ((1, 6), (-1, 2), (4, 2)):
        a, b = make_pair(
            "pbs", "mock", RdmaBackendConfig(qp_per_transfer=2, post_batch_size=post_batch_size), hold=True
        )
        try:
            _, mx = register(a, 8192)
            _, my = register(b, 8192)
            session = a.create_session(mx, my)
            assert session is not None
            status = session.batch_read(*scattered(6), 0)
            assert status.WaitFor(20) is StatusCode.IN_PROGRESS
            assert on_loop(a, outstanding, a) == posts  # one moriio_async transfer per post
            assert sum(held_counts(a, session)) == 6
            step(a, session, 0)
            step(a, session, 1)
            assert status.WaitFor(5000) is StatusCode.SUCCESS
        finally:
            a.close()
            b.close()


def test_striping_over_tcp_queue_pairs_moves_every_byte() -> None:
    a, b = make_pair("stripe-tcp", "tcp", RdmaBackendConfig(qp_per_transfer=4))
    try:
        x, mx = register(a, 1 << 20)
        y, my = register(b, 1 << 20, fill=0)
        session = a.create_session(mx, my)
        assert session is not None and len({s.channel.qp_num for s in session.stripes}) == 4
        rng = np.random.default_rng(3)
        blocks = rng.permutation(256)[:100]
        lo = [int(i) * 4096 for i in blocks]
        ro = [int(i) * 4096 for i in rng.permutation(256)[:100]]
        statuses = [session.batch_write(lo, ro, [4096] * 100, uid) for uid in range(4)]
        assert a.wait_all(statuses, 20_000) is StatusCode.SUCCESS
        for lo_i, ro_i in zip(lo, ro, strict=True):
            assert np.array_equal(x[lo_i : lo_i + 4096], y[ro_i : ro_i + 4096])
        assert all(wait_inbound(b, a.key, uid) is not None for uid in range(4))
    finally:
        a.close()
        b.close()


def test_a_session_closing_with_a_drain_timeout_lets_held_requests_end_and_aborts_them_at_the_timeout(
    held: tuple[IOEngine, IOEngine],
) -> None:
    a, b = held
    _, mx = register(a, 8192)
    _, my = register(b, 8192)
    lo, ro, sz = scattered(8)
    drained, aborted = a.create_session(mx, my), a.create_session(mx, my)
    assert drained is not None and aborted is not None
    ends = drained.batch_write(lo, ro, sz, 0)
    cut = aborted.batch_write(lo, ro, sz, 0)
    assert ends.WaitFor(20) is StatusCode.IN_PROGRESS and cut.WaitFor(20) is StatusCode.IN_PROGRESS
    closing = asyncio.run_coroutine_threadsafe(drained.aclose(drain_timeout=30), a.loop)
    while not on_loop(a, lambda: drained.closed):  # the close has begun: the steps below happen during it
        time.sleep(0.001)
    step(a, drained, 0)
    step(a, drained, 1)
    closing.result(10)
    assert ends.WaitFor(5000) is StatusCode.SUCCESS  # the drain let both stripes end before the close
    # nothing steps these: the close stops draining at the timeout, without an error, and aborts them
    asyncio.run_coroutine_threadsafe(aborted.aclose(drain_timeout=0.05), a.loop).result(10)
    assert cut.WaitFor(5000) is not StatusCode.IN_PROGRESS and cut.Failed()
    assert drained.closed and aborted.closed and not any(s.alive() for s in drained.stripes + aborted.stripes)


def test_a_part_refused_at_posting_ends_with_its_reason_and_the_other_stripes_still_post(
    held: tuple[IOEngine, IOEngine],
) -> None:
    a, b = held
    _, mx = register(a, 8192)
    _, my = register(b, 8192)
    session = a.create_session(mx, my)
    assert session is not None
    asyncio.run_coroutine_threadsafe(session.stripes[1].close(), a.loop).result(10)
    status = session.batch_write(*scattered(8), 1)  # uid 1: the first post goes to the closed stripe 1
    assert status.WaitFor(20) is StatusCode.IN_PROGRESS  # stripe 0 still holds its part
    assert held_counts(a, session)[0] == 4
    step(a, session, 0)
    assert status.WaitFor(5000) is StatusCode.ERR_BAD_STATE
    assert "closed" in status.Message(), status.Message()
