from __future__ import annotations

from moriio_async.core.sendq import Entry, SendQueue
from moriio_async.status import WcStatus


def entries(owner: str, n: int) -> list[Entry[str]]:
    return [Entry(owner, i, i == n - 1) for i in range(n)]


def test_backpressure_posts_at_most_depth_in_order() -> None:
    q: SendQueue[str] = SendQueue(4)
    q.enqueue(entries("t", 10))
    first = q.take_postable()
    assert [e.payload for e in first] == [0, 1, 2, 3]
    assert q.take_postable() == []
    # depth 4 -> signal every 1; each completion frees one slot
    done = q.complete(first[0].wr_id, WcStatus.SUCCESS)
    assert [e.payload for e, _ in done] == [0]
    assert [e.payload for e in q.take_postable()] == [4]


def test_only_last_of_owner_and_every_quarter_depth_is_signaled() -> None:
    q: SendQueue[str] = SendQueue(16)
    q.enqueue(entries("a", 10) + entries("b", 2))
    posted = q.take_postable()
    assert [e.signaled for e in posted] == [
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
    q.enqueue(entries("a", 10))
    posted = q.take_postable()
    done = q.complete(posted[3].wr_id, WcStatus.SUCCESS)
    assert [(e.payload, s) for e, s in done] == [(i, WcStatus.SUCCESS) for i in range(4)]
    assert q.free_slots == 16 - 6


def test_error_stops_posting_and_flushes_waiting_only_after_drain() -> None:
    q: SendQueue[str] = SendQueue(2)
    q.enqueue(entries("a", 5))
    p = q.take_postable()
    done = q.complete(p[0].wr_id, WcStatus.REM_ACCESS_ERR)
    assert done[0][1] is WcStatus.REM_ACCESS_ERR
    assert q.failed and q.take_postable() == []
    assert q.flush_waiting() == []  # one still in flight: flushes must keep posting order
    q.complete(p[1].wr_id, WcStatus.WR_FLUSH_ERR)
    flushed = q.flush_waiting()
    assert [(e.payload, s) for e, s in flushed] == [(i, WcStatus.WR_FLUSH_ERR) for i in (2, 3, 4)]
    assert q.idle


def test_unknown_wr_id_covers_nothing() -> None:
    q: SendQueue[str] = SendQueue(4)
    q.enqueue(entries("a", 2))
    q.take_postable()
    assert q.complete(999, WcStatus.SUCCESS) == []
    assert len(q.in_flight) == 2
