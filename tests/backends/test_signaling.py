"""Selective signaling and send-queue slots: a slot comes back when the completion covering it is polled."""

from __future__ import annotations

import select

import pytest

from moriio_async.backends.base import SendQueueFull
from moriio_async.status import WcStatus

from .harness import WAIT, PairFactory, digest, statuses, wr_ids

pytestmark = pytest.mark.timeout(60)

SIZE = 4096


def test_unsignaled_successes_make_no_completion(pairs: PairFactory) -> None:
    pair = pairs()
    pair.a.buf[:] = 1
    wrs = [pair.write(i, i * SIZE, SIZE, i * SIZE, signaled=False) for i in range(5)]
    wrs.append(pair.write(5, 5 * SIZE, SIZE, 5 * SIZE))

    wcs = pair.run(wrs, expect=1)

    assert wr_ids(wcs) == [5] and statuses(wcs) == [WcStatus.SUCCESS]
    assert (pair.b.buf[: 6 * SIZE] == 1).all(), "an unsignaled WRITE did not land"
    pair.waiter.expect_none()

    # Unsignaled alone: the data lands, no completion ever comes.
    pair.a.buf[:] = 2
    pair.a.qp.post_send([pair.write(10 + i, i * SIZE, SIZE, i * SIZE, signaled=False) for i in range(3)])
    pair.waiter.expect_none()
    assert (pair.b.buf[: 3 * SIZE] == 2).all()


def test_send_queue_full_exactly_when_full_and_slots_return_on_poll(pairs: PairFactory) -> None:
    pair = pairs(sq_depth=16)
    qp, cq = pair.a.qp, pair.a.cq
    depth = qp.max_send_wr
    assert depth >= 16

    # depth - 1 unsignaled and one signaled: the queue is exactly full.
    qp.post_send([pair.write(i, 0, SIZE, 0, signaled=i == depth - 1) for i in range(depth)])
    with pytest.raises(SendQueueFull):
        qp.post_send([pair.write(100, 0, SIZE, 0)])

    # The covering completion has arrived but is not polled yet: still full.
    fd = cq.fileno()
    if fd >= 0:
        assert select.select([fd], [], [], WAIT)[0], "no completion event"
    with pytest.raises(SendQueueFull):
        qp.post_send([pair.write(101, 0, SIZE, 0)])

    # Polling the one signaled completion frees all depth slots.
    assert wr_ids(pair.waiter.wait(1)) == [depth - 1]
    qp.post_send([pair.write(200 + i, 0, SIZE, 0) for i in range(depth)])
    with pytest.raises(SendQueueFull):
        qp.post_send([pair.write(300, 0, SIZE, 0)])

    # Poll three: exactly three slots come back; a list of four is refused whole.
    assert wr_ids(pair.waiter.wait(3)) == [200, 201, 202]
    with pytest.raises(SendQueueFull):
        qp.post_send([pair.write(400 + i, 0, SIZE, 0) for i in range(4)])
    qp.post_send([pair.write(500 + i, 0, SIZE, 0) for i in range(3)])

    rest = pair.waiter.wait(depth - 3 + 3)
    assert wr_ids(rest) == [*range(203, 200 + depth), 500, 501, 502], "a refused request was posted"
    assert set(statuses(rest)) == {WcStatus.SUCCESS}
    pair.waiter.expect_none(0.2)


def test_failure_completion_covers_earlier_unsignaled_requests(pairs: PairFactory) -> None:
    pair = pairs(sq_depth=16)
    qp = pair.a.qp
    depth = qp.max_send_wr
    untouched = digest(pair.b.buf[SIZE:])
    wrs = [pair.write(i, 0, SIZE, 0, signaled=False) for i in range(depth - 2)]
    wrs.append(pair.write(depth - 2, 0, SIZE, 0, rkey=pair.b.mr.rkey ^ 0x5A5A5A5A, signaled=False))
    wrs.append(pair.write(depth - 1, 0, SIZE, 0, signaled=False))
    qp.post_send(wrs)

    wcs = pair.waiter.wait(2)  # the failure and the flush complete although unsignaled
    assert wr_ids(wcs) == [depth - 2, depth - 1]
    assert statuses(wcs) == [WcStatus.REM_ACCESS_ERR, WcStatus.WR_FLUSH_ERR]
    assert (pair.b.buf[:SIZE] == 0).all(), "the unsignaled WRITEs before the failure did not land"
    assert digest(pair.b.buf[SIZE:]) == untouched

    # Every slot is free again: a whole queue posts on the (now ERR) pair and flushes.
    qp.post_send([pair.write(1000 + i, 0, SIZE, 0) for i in range(depth)])
    flushed = pair.waiter.wait(depth)
    assert wr_ids(flushed) == list(range(1000, 1000 + depth))
    assert set(statuses(flushed)) == {WcStatus.WR_FLUSH_ERR}
