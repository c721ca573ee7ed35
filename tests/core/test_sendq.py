from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from moriio_async.core.sendq import Chunk, SendQueue
from moriio_async.status import WcStatus


def flat(chunks: list[Chunk[str]]) -> list[tuple[str, int, int, bool]]:
    """(owner, request index, wr_id, signaled) for every request posted."""
    return [(c.owner, c.start + k, c.wr_id + k, bool(c.signaled[k])) for c in chunks for k in range(c.stop - c.start)]


def test_backpressure_posts_at_most_depth_in_order() -> None:
    q: SendQueue[str] = SendQueue(4)
    q.enqueue("t", 10)
    first = flat(q.take_postable())
    assert [i for _, i, _, _ in first] == [0, 1, 2, 3]
    assert q.take_postable() == []
    # depth 4 -> signal every 1; each completion frees one slot
    assert q.complete(first[0][2], WcStatus.SUCCESS) == [("t", 1, WcStatus.SUCCESS)]
    assert [i for _, i, _, _ in flat(q.take_postable())] == [4]


def test_only_last_of_owner_and_every_quarter_depth_is_signaled() -> None:
    q: SendQueue[str] = SendQueue(16)
    q.enqueue("a", 10)
    q.enqueue("b", 2)
    chunks = q.take_postable()
    assert [(c.owner, c.start, c.stop) for c in chunks] == [("a", 0, 10), ("b", 0, 2)]
    assert [s for *_, s in flat(chunks)] == [
        False,
        False,
        False,
        True,
        False,
        False,
        False,
        True,
        False,
        True,
        False,
        True,
    ]


def test_signaled_completion_covers_earlier_unsignaled() -> None:
    q: SendQueue[str] = SendQueue(16)
    q.enqueue("a", 10)
    posted = flat(q.take_postable())
    assert q.complete(posted[3][2], WcStatus.SUCCESS) == [("a", 3, WcStatus.SUCCESS), ("a", 1, WcStatus.SUCCESS)]
    assert q.free_slots == 16 - 6


def test_error_stops_posting_and_flushes_waiting_only_after_drain() -> None:
    q: SendQueue[str] = SendQueue(2)
    q.enqueue("a", 5)
    p = flat(q.take_postable())
    assert q.complete(p[0][2], WcStatus.REM_ACCESS_ERR) == [("a", 1, WcStatus.REM_ACCESS_ERR)]
    assert q.failed and q.take_postable() == []
    assert q.flush_waiting() == []  # one still in flight: flushes must keep posting order
    q.complete(p[1][2], WcStatus.WR_FLUSH_ERR)
    assert q.flush_waiting() == [("a", 3, WcStatus.WR_FLUSH_ERR)]
    assert q.idle


def test_unknown_wr_id_covers_nothing() -> None:
    q: SendQueue[str] = SendQueue(4)
    q.enqueue("a", 2)
    q.take_postable()
    assert q.complete(999, WcStatus.SUCCESS) == []
    assert q.in_flight == 2


@given(
    st.integers(1, 64),
    st.lists(st.integers(1, 300), min_size=1, max_size=12),
    st.randoms(use_true_random=False),
)
def test_spans_account_every_request_exactly_once_and_in_order(depth: int, sizes: list[int], rnd: object) -> None:
    """Property: whatever the depth and the owners' sizes, completing signaled requests (and the odd
    unsignaled one, as a verbs flush would) accounts every request once, per owner in order, holding
    at most ``depth`` in flight, and signals each owner's last request."""
    import random

    assert isinstance(rnd, random.Random)
    q: SendQueue[int] = SendQueue(depth)
    for owner, n in enumerate(sizes):
        q.enqueue(owner, n)
    done = [0] * len(sizes)
    posted: list[tuple[int, int, int, bool]] = []
    while not q.idle:
        chunks = q.take_postable()
        for c in chunks:
            posted += [(c.owner, c.start + k, c.wr_id + k, bool(c.signaled[k])) for k in range(c.stop - c.start)]
            if c.stop == sizes[c.owner]:
                assert bool(c.signaled[-1])
        assert q.in_flight <= depth
        outstanding = [p for p in posted if p[2] >= min((p2[2] for p2 in posted), default=0)]
        signaled = [p for p in outstanding if p[3]]
        pick = signaled[0] if signaled and rnd.random() < 0.9 else outstanding[0]
        posted = [p for p in posted if p[2] > pick[2]]
        for owner, count, status in q.complete(pick[2], WcStatus.SUCCESS):
            assert status is WcStatus.SUCCESS
            done[owner] += count
            assert all(done[o] == sizes[o] for o in range(owner))  # owners end in posting order
    assert done == sizes


@given(
    st.integers(1, 16),
    st.lists(st.tuples(st.integers(1, 40), st.booleans()), min_size=1, max_size=30),
)
def test_post_one_posts_as_enqueue_then_take_postable_would(depth: int, steps: list[tuple[int, bool]]) -> None:
    """Property: a queue that sends one-request owners through ``post_one`` whenever it accepts them
    posts the same requests, with the same wr_ids and signal flags, and settles the same counts, as
    one that always enqueues; ``post_one`` refuses whenever something waits or no slot is free."""
    a: SendQueue[int] = SendQueue(depth)
    b: SendQueue[int] = SendQueue(depth)
    posted_a: list[tuple[int, int, int, bool]] = []
    posted_b: list[tuple[int, int, int, bool]] = []
    for owner, (size, complete) in enumerate(steps):
        n = 1 if size <= 20 else size - 20
        a.enqueue(owner, n)
        posted_a += flat(a.take_postable())
        wr_id = b.post_one(owner) if n == 1 else None
        if wr_id is None:
            assert n > 1 or b.waiting or b.free_slots == 0
            b.enqueue(owner, n)
            posted_b += flat(b.take_postable())
        else:
            posted_b.append((owner, 0, wr_id, True))
        assert posted_a == posted_b
        if complete and posted_a:
            wr = posted_a[-1][2]
            assert a.complete(wr, WcStatus.SUCCESS) == b.complete(wr, WcStatus.SUCCESS)
            posted_a += flat(a.take_postable())
            posted_b += flat(b.take_postable())
    assert (a.in_flight, a.waiting) == (b.in_flight, b.waiting)
