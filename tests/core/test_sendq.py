from __future__ import annotations

import pytest
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


def test_a_depth_below_one_and_an_empty_owner_are_refused() -> None:
    import pytest

    with pytest.raises(ValueError, match=r"^send-queue depth must be >= 1$"):
        SendQueue(0)
    q: SendQueue[str] = SendQueue(1)
    assert (q.depth, q.signal_every, q.free_slots) == (1, 1, 1)
    with pytest.raises(ValueError, match=r"^an owner queues at least one request$"):
        q.enqueue("a", 0)
    assert q.idle and q.waiting == 0


def test_wr_ids_start_at_one_or_where_told_and_signal_every_is_a_quarter_of_the_depth() -> None:
    q: SendQueue[str] = SendQueue(7)
    assert q.signal_every == 1
    q.enqueue("a", 2)
    assert [(c.wr_id, c.start, c.stop) for c in q.take_postable()] == [(1, 0, 2)]
    r: SendQueue[str] = SendQueue(13, first_wr_id=100)
    assert r.signal_every == 3
    assert r.post_one("x") == 100
    r.enqueue("a", 8)
    (chunk,) = r.take_postable()
    assert chunk.wr_id == 101
    assert chunk.signaled.tolist() == [False, False, True, False, False, True, False, True]
    assert (r.in_flight, r.waiting, r.free_slots) == (9, 0, 4)


def test_post_one_refuses_when_something_waits_the_queue_is_full_or_failed() -> None:
    q: SendQueue[str] = SendQueue(2)
    assert q.post_one("a") == 1
    assert q.post_one("b") == 2
    assert q.post_one("c") is None  # full
    assert q.in_flight == 2 and q.waiting == 0
    assert q.complete(1, WcStatus.SUCCESS) == [("a", 1, WcStatus.SUCCESS)]
    q.enqueue("d", 1)
    assert q.post_one("e") is None  # d waits: e would overtake it
    assert flat(q.take_postable()) == [("d", 0, 3, True)]
    assert q.complete(2, WcStatus.REM_ACCESS_ERR) == [("b", 1, WcStatus.REM_ACCESS_ERR)]
    assert q.post_one("f") is None  # failed, though a slot is free
    assert q.free_slots == 1


def test_a_run_cut_by_a_full_queue_keeps_counting_towards_its_signal() -> None:
    """An owner's requests split over two postings: the unsignaled run carries over, so the next
    signal still comes ``signal_every`` requests after the last one."""
    q: SendQueue[str] = SendQueue(8)  # signal every 2
    q.enqueue("a", 11)
    first = q.take_postable()
    assert [(c.start, c.stop, c.signaled.tolist()) for c in first] == [(0, 8, [False, True] * 4)]
    assert q.complete(first[0].wr_id + 2, WcStatus.SUCCESS) == [("a", 2, WcStatus.SUCCESS), ("a", 1, WcStatus.SUCCESS)]
    second = q.take_postable()
    assert [(c.start, c.stop, c.wr_id, c.signaled.tolist()) for c in second] == [(8, 11, 9, [False, True, True])]
    q.enqueue("b", 3)
    assert q.take_postable() == []  # full: 5 + 3 in flight
    assert q.complete(11, WcStatus.SUCCESS) == [
        ("a", 5, WcStatus.SUCCESS),  # the whole first span
        ("a", 2, WcStatus.SUCCESS),  # the second span's requests before the named one
        ("a", 1, WcStatus.SUCCESS),
    ]
    q2: SendQueue[str] = SendQueue(8)
    q2.enqueue("a", 3)  # its last request is signaled, so b's run starts from 0
    q2.enqueue("b", 5)
    assert [c.signaled.tolist() for c in q2.take_postable()] == [[False, True, True], [False, True, False, True, True]]


def test_after_a_failure_earlier_requests_are_flushes_and_the_pair_can_be_reset() -> None:
    import pytest

    q: SendQueue[str] = SendQueue(8)
    q.enqueue("a", 3)
    q.enqueue("b", 3)
    q.enqueue("c", 4)
    q.take_postable()
    assert q.complete(2, WcStatus.RETRY_EXC_ERR) == [("a", 1, WcStatus.SUCCESS), ("a", 1, WcStatus.RETRY_EXC_ERR)]
    assert q.failed
    # The backend reports every request itself once failed: an earlier one covered by a later
    # completion is a flush, not a success.
    assert q.complete(5, WcStatus.WR_FLUSH_ERR) == [
        ("a", 1, WcStatus.WR_FLUSH_ERR),
        ("b", 1, WcStatus.WR_FLUSH_ERR),
        ("b", 1, WcStatus.WR_FLUSH_ERR),
    ]
    with pytest.raises(RuntimeError, match=r"^reset with requests still in flight$"):
        q.reset()
    assert q.flush_waiting() == []  # b's last and c's first 2 are still in flight
    assert q.fail_all_in_flight() == [("b", 1, WcStatus.WR_FLUSH_ERR), ("c", 2, WcStatus.WR_FLUSH_ERR)]
    assert q.in_flight == 0 and q.failed
    assert q.flush_waiting() == [("c", 2, WcStatus.WR_FLUSH_ERR)]
    assert q.idle
    q.reset()
    assert q.failed is False
    q.enqueue("d", 2)
    assert flat(q.take_postable()) == [("d", 0, 9, False), ("d", 1, 10, True)]


def test_drop_waiting_removes_only_unposted_requests_and_success_does_not_fail() -> None:
    q: SendQueue[str] = SendQueue(2)
    q.enqueue("a", 3)
    q.enqueue("b", 1)
    q.take_postable()
    assert q.drop_waiting() == [("a", 1), ("b", 1)]
    assert (q.waiting, q.in_flight) == (0, 2)
    assert q.flush_waiting() == []  # not failed
    assert q.complete(2, WcStatus.SUCCESS) == [("a", 1, WcStatus.SUCCESS), ("a", 1, WcStatus.SUCCESS)]
    assert not q.failed and q.idle and q.free_slots == 2
    assert q.complete(2, WcStatus.SUCCESS) == []  # nothing in flight


def test_complete_ignores_wr_ids_outside_the_in_flight_range() -> None:
    q: SendQueue[str] = SendQueue(4, first_wr_id=10)
    q.enqueue("a", 2)
    q.enqueue("b", 2)
    q.take_postable()  # wr_ids 10..13
    assert q.complete(9, WcStatus.SUCCESS) == []
    assert q.complete(14, WcStatus.SUCCESS) == []
    assert q.in_flight == 4
    assert q.complete(13, WcStatus.SUCCESS) == [
        ("a", 2, WcStatus.SUCCESS),
        ("b", 1, WcStatus.SUCCESS),
        ("b", 1, WcStatus.SUCCESS),
    ]
    assert q.in_flight == 0


def test_an_odd_run_left_unsignaled_carries_into_the_next_posting() -> None:
    q: SendQueue[str] = SendQueue(8)  # signal every 2
    assert q.failed is False
    q.enqueue("a", 20)
    assert [c.signaled.tolist() for c in q.take_postable()] == [[False, True] * 4]
    q.complete(3, WcStatus.SUCCESS)  # 3 slots back
    assert [(c.wr_id, c.signaled.tolist()) for c in q.take_postable()] == [(9, [False, True, False])]
    q.complete(5, WcStatus.SUCCESS)  # 2 slots back; one unsignaled request (11) is pending its signal
    assert [(c.wr_id, c.signaled.tolist()) for c in q.take_postable()] == [(12, [True, False])]


def test_a_completion_naming_the_first_request_of_a_span_ends_the_span_before_it() -> None:
    q: SendQueue[str] = SendQueue(4, first_wr_id=10)
    q.enqueue("a", 2)
    q.enqueue("b", 2)
    q.take_postable()  # a: 10, 11; b: 12, 13
    assert q.complete(12, WcStatus.REM_ACCESS_ERR) == [("a", 2, WcStatus.SUCCESS), ("b", 1, WcStatus.REM_ACCESS_ERR)]
    assert q.in_flight == 1


@pytest.mark.parametrize("depth", [4, 16, 64])
def test_short_owners_get_the_flags_the_rule_gives(depth: int) -> None:
    """Owners of 1-20 requests (the short ones take shared last-only flags): one signaled request in
    every ``depth // 4`` since the last signaled one, and every owner's last, as for long owners."""
    q: SendQueue[int] = SendQueue(depth)
    counts = [3, 1, 5, 2, 20, 7, 1, 16, 4, 9]
    every, run = max(1, depth // 4), 0
    for owner, count in enumerate(counts):
        q.enqueue(owner, count)
        while q.waiting:
            for chunk in q.take_postable():
                take = chunk.stop - chunk.start
                want = [(run + j + 1) % every == 0 for j in range(take)]
                if chunk.stop == counts[chunk.owner]:
                    want[-1] = True
                assert chunk.signaled.tolist() == want
                run = 0 if want[-1] else (run + take) % every
                last = chunk.wr_id + take - 1
            q.complete(last, WcStatus.SUCCESS)  # every slot back
