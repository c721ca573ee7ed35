"""The completion reader: no missed wakeups, batched dispatch, clean removal."""

from __future__ import annotations

import asyncio
import threading

from moriio_async.aio.cq_reader import CompletionReader
from moriio_async.backends.softcq import SoftCompletionQueue
from moriio_async.status import Opcode, WcStatus
from moriio_async.work import WorkCompletion


def wc(i: int) -> WorkCompletion:
    return WorkCompletion(i, WcStatus.SUCCESS, Opcode.RDMA_WRITE, 1, 1)


class NoSlots:
    def release_slots(self, n: int) -> None:
        pass


class Queue(SoftCompletionQueue):
    """The software NIC's completion queue, fed directly by the test."""

    def __init__(self) -> None:
        super().__init__(1 << 16)

    def add(self, completion: WorkCompletion) -> None:
        self.push(completion, NoSlots(), 0)


async def test_completions_racing_the_rearm_are_never_missed() -> None:
    """A producer thread adds completions in bursts while the loop re-arms; every one is seen
    through fd wakeups alone (no drain is called by the test, no timer polls)."""
    loop = asyncio.get_running_loop()
    cq = Queue()
    total = 20000
    seen: list[int] = []
    all_seen = loop.create_future()

    def dispatch(wcs: list[WorkCompletion]) -> None:
        seen.extend(w.wr_id for w in wcs)
        if len(seen) == total and not all_seen.done():
            all_seen.set_result(None)

    reader = CompletionReader(loop, cq, dispatch, batch=16)
    reader.start()

    def produce() -> None:
        for i in range(total):
            cq.add(wc(i))
            if i % 97 == 0:
                threading.Event().wait(0.0001)  # let the loop thread interleave

    thread = threading.Thread(target=produce)
    thread.start()
    try:
        await asyncio.wait_for(all_seen, 30)
    finally:
        thread.join()
        reader.close()
        cq.close()
    assert seen == list(range(total))
    stats = reader.statistics()
    assert stats.completions == total and not stats.fallback_polling
    assert stats.wakeups < total  # batched: one wakeup resolves many


async def test_polling_before_arming_would_miss_a_completion() -> None:
    """The reader's order matters: a completion added between an empty poll and the arm raises
    no event. This shows the hazard the reader's order avoids, on the same queue type."""
    cq = Queue()
    try:
        assert cq.poll() == []  # wrong order: poll first ...
        cq.add(wc(1))  # ... a completion lands before the arm ...
        cq.req_notify()  # ... and arming now raises nothing for it.
        assert cq.get_event() is False
        # The reader's order (get_event, arm, then poll) finds it.
        assert [w.wr_id for w in cq.poll()] == [1]
    finally:
        cq.close()


async def test_fallback_polling_without_a_channel_fd() -> None:
    loop = asyncio.get_running_loop()

    class NoFdQueue(Queue):
        def fileno(self) -> int:
            return -1

    cq = NoFdQueue()
    got: list[int] = []
    done = loop.create_future()

    def dispatch(wcs: list[WorkCompletion]) -> None:
        got.extend(w.wr_id for w in wcs)
        if len(got) == 3 and not done.done():
            done.set_result(None)

    reader = CompletionReader(loop, cq, dispatch, has_work=lambda: len(got) < 3)
    reader.start()
    try:
        for i in range(3):
            cq.add(wc(i))
        reader.kick()
        await asyncio.wait_for(done, 5)
        assert reader.statistics().fallback_polling
    finally:
        reader.close()
        cq.close()
    assert got == [0, 1, 2]


async def test_close_removes_the_reader() -> None:
    loop = asyncio.get_running_loop()
    cq = Queue()
    calls: list[int] = []
    reader = CompletionReader(loop, cq, lambda wcs: calls.append(len(wcs)))
    reader.start()
    reader.close()
    reader.close()
    cq.add(wc(1))  # the queue was armed: this makes the fd readable
    for _ in range(20):
        await asyncio.sleep(0)
    assert calls == []  # nobody is watching the fd any more
    cq.close()
