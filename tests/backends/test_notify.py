"""The completion channel: arm, event, poll until empty, and never a missed wakeup."""

from __future__ import annotations

import os
import random
import select
import threading
import time

import numpy as np
import pytest

from moriio_async.backends import open_backend
from moriio_async.backends.base import CompletionQueue
from moriio_async.status import Opcode, WcStatus
from moriio_async.work import WorkCompletion, WorkRequest

from .harness import ALL, WAIT, CqWaiter, PairFactory, connect, make_options, wr_ids

pytestmark = pytest.mark.timeout(60)


def readable(fd: int, timeout: float = 0.0) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])


def poll_until(cq: CompletionQueue, n: int) -> list[WorkCompletion]:
    """Busy-poll (no channel involved) for ``n`` completions."""
    got: list[WorkCompletion] = []
    deadline = time.monotonic() + WAIT
    while len(got) < n:
        assert time.monotonic() < deadline, f"only {got}"
        got += cq.poll(n - len(got))
        time.sleep(0.0005)
    return got


def channel_fd(cq: CompletionQueue) -> int:
    fd = cq.fileno()
    if fd < 0:
        pytest.skip("this backend has no completion channel fd")
    return fd


def test_channel_protocol(pairs: PairFactory) -> None:
    pair = pairs()
    cq = pair.a.cq
    fd = channel_fd(cq)
    assert not cq.get_event(), "an event with nothing pending"
    assert not readable(fd)

    # Spend whatever arming the waiter left: one completion fires it, if armed.
    pair.run([pair.write(1, 0, 64, 0)])
    pair.a.qp.post_send([pair.write(2, 0, 64, 0)])
    assert wr_ids(poll_until(cq, 1)) == [2]
    cq.get_event()
    assert not readable(fd)

    # Not armed: a completion arrives and the fd stays quiet.
    pair.a.qp.post_send([pair.write(3, 0, 64, 0)])
    assert wr_ids(poll_until(cq, 1)) == [3]
    assert not readable(fd, 0.1), "an unarmed queue raised an event"

    # Armed: the next completion makes the fd readable, once.
    cq.req_notify()
    cq.req_notify()
    pair.a.qp.post_send([pair.write(4, 0, 64, 0), pair.write(5, 0, 64, 0)])
    assert readable(fd, WAIT)
    assert cq.get_event() is True
    assert not readable(fd)
    assert not cq.get_event()
    assert wr_ids(poll_until(cq, 2)) == [4, 5]
    time.sleep(0.1)
    assert not readable(fd), "a second event without re-arming"


def test_no_missed_wakeup_with_real_queue_pairs(pairs: PairFactory, backend_name: str) -> None:
    """Completions race the consumer's re-arm; only fd readiness wakes it, and no wait may expire."""
    pair = pairs(sq_depth=64)
    channel_fd(pair.a.cq)
    qp, waiter = pair.a.qp, pair.waiter
    rng = random.Random(5)
    total, posted, done = 4000, 0, 0
    seen: list[int] = []
    while done < total:
        room = qp.max_send_wr - (posted - done)
        burst = min(room, rng.randint(1, 8), total - posted)
        if burst:
            qp.post_send([pair.write(posted + i, 64 * (posted + i) % 4096, 64, 0) for i in range(burst)])
            posted += burst
        got = waiter.wait_some(timeout=WAIT)  # a missed wakeup would sit here until WAIT expires
        assert all(wc.status is WcStatus.SUCCESS for wc in got)
        seen += wr_ids(got)
        done += len(got)
    assert seen == list(range(total))
    # Soft-RoCE on one device completes inside ibv_post_send, before the consumer sleeps, so
    # only the TCP NIC's completions are certain to arrive asynchronously here.
    if backend_name == "tcp":
        assert waiter.wakeups > 0, "no completion ever arrived asynchronously: the channel was not exercised"


def test_no_missed_wakeup_two_pairs_one_queue(pairs: PairFactory, backend_name: str) -> None:
    """Two pairs complete into one CQ from their own NIC contexts while the consumer re-arms."""
    pair = pairs(sq_depth=32)
    channel_fd(pair.a.cq)
    qp2 = pair.a.backend.create_qp(pair.a.cq)  # a second pair, same CQ, to a second target
    peer = open_backend(backend_name, make_options())
    try:
        peer_cq = peer.create_cq(64)
        peer_qp = peer.create_qp(peer_cq)
        connect(qp2, peer_qp)
        peer_buf = np.zeros(4096, np.uint8)
        peer_mr = peer.register_memory(memoryview(peer_buf), ALL)
        peer.export_memory(peer_mr)
        targets = {pair.a.qp.qp_num: (pair.a.qp, pair.b.mr), qp2.qp_num: (qp2, peer_mr)}
        per_pair = 1500
        posted = dict.fromkeys(targets, 0)
        seen: dict[int, list[int]] = {n: [] for n in targets}
        while sum(map(len, seen.values())) < 2 * per_pair:
            for n, (qp, mr) in targets.items():
                burst = min(qp.max_send_wr - (posted[n] - len(seen[n])), 4, per_pair - posted[n])
                if burst > 0:
                    sge = (pair.a.sge(0, 64),)
                    qp.post_send(
                        [WorkRequest(posted[n] + i, Opcode.RDMA_WRITE, sge, mr.addr, mr.rkey) for i in range(burst)]
                    )
                    posted[n] += burst
            for wc in pair.waiter.wait_some(timeout=WAIT):  # fd readiness only
                assert wc.status is WcStatus.SUCCESS, wc
                seen[wc.qp_num].append(wc.wr_id)
        for ids in seen.values():
            assert ids == list(range(per_pair)), "completions of one pair out of order"
        qp2.close()
        peer_qp.close()
        peer_cq.close()
        peer.deregister_memory(peer_mr)
    finally:
        peer.close()


@pytest.mark.only_backends("tcp", "mock", reason="adds completions directly through the software completion queue")
def test_no_missed_wakeup_cq_level_race(backend_name: str) -> None:
    from moriio_async.backends.soft.cq import SoftCompletionQueue

    backend = open_backend(backend_name, make_options())
    try:
        cq = backend.create_cq(1024)
        assert isinstance(cq, SoftCompletionQueue)

        class Owner:
            released = 0

            def release_slots(self, n: int) -> None:
                self.released += n

        owner, total = Owner(), 50_000

        def produce() -> None:
            rng = random.Random(7)
            for i in range(total):
                cq.push(WorkCompletion(i, WcStatus.SUCCESS, Opcode.RDMA_WRITE, 1, 1), owner, 1)
                if rng.random() < 0.01:
                    time.sleep(0)  # let the consumer run between re-arm and poll
                if rng.random() < 0.001:
                    time.sleep(0.001)

        waiter = CqWaiter(cq)
        producer = threading.Thread(target=produce)
        producer.start()
        seen: list[int] = []
        while len(seen) < total:
            seen += wr_ids(waiter.wait_some(timeout=WAIT, max_entries=rng_max(len(seen))))
        producer.join()
        assert seen == list(range(total))
        assert owner.released == total
        cq.close()
    finally:
        backend.close()


def rng_max(i: int) -> int:
    return 1 + (i * 7919) % 97  # varied poll sizes: sometimes one at a time


def test_channel_fd_is_nonblocking(pairs: PairFactory) -> None:
    fd = channel_fd(pairs().a.cq)
    assert os.get_blocking(fd) is False
