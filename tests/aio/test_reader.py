"""The completion reader: no missed wakeups, batched dispatch, clean removal."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, cast

import pytest

from moriio_async.aio.cq_reader import CompletionReader
from moriio_async.backends.base import CompletionQueue
from moriio_async.backends.soft.cq import SoftCompletionQueue
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


class LateQueue(CompletionQueue):
    """A completion queue kept exactly by the contract in backends/base.py (an eventfd channel: after
    ``req_notify`` the next completion added makes it readable, once), whose ``poll`` lands one of
    ``late`` the moment it has found the queue empty: just after a reader's last empty poll and before
    its callback returns, the window the reader's order (get event, re-arm, then poll) must cover."""

    def __init__(self) -> None:
        self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._armed = False
        self._entries: deque[WorkCompletion] = deque()
        self.late: list[WorkCompletion] = []
        self.landed: list[int] = []

    def fileno(self) -> int:
        return self._fd

    def req_notify(self) -> None:
        self._armed = True

    def get_event(self) -> bool:
        try:
            os.eventfd_read(self._fd)
        except BlockingIOError:
            return False
        return True

    def add(self, completion: WorkCompletion) -> None:
        self._entries.append(completion)
        if self._armed:
            self._armed = False
            os.eventfd_write(self._fd, 1)

    def poll(self, max_entries: int = 64) -> list[WorkCompletion]:
        out = [self._entries.popleft() for _ in range(min(max_entries, len(self._entries)))]
        if not out and self.late:
            # The caller is told "empty"; the NIC adds a completion before the caller does anything else.
            late = self.late.pop(0)
            self.landed.append(late.wr_id)
            self.add(late)
        return out

    def close(self) -> None:
        os.close(self._fd)


@pytest.mark.parametrize("window", ["wakeup", "start"])
async def test_a_completion_landing_after_the_last_empty_poll_is_delivered(window: str) -> None:
    """A completion that lands right after the reader's last empty poll, before its callback ends (or,
    at start, before start() returns), is delivered by the reader alone: no drain from outside, no
    timer. With the order get event, poll, re-arm (or poll before the first arm) it raises no event
    and is never seen."""
    loop = asyncio.get_running_loop()
    cq = LateQueue()
    got: list[int] = []
    both = loop.create_future()

    def dispatch(wcs: list[WorkCompletion]) -> None:
        got.extend(w.wr_id for w in wcs)
        if len(got) == 2 and not both.done():
            both.set_result(None)

    reader = CompletionReader(loop, cq, dispatch)
    try:
        if window == "start":
            cq.late = [wc(0), wc(1)]  # start()'s drain finds the queue empty: 0 lands, then 1 on the next
            reader.start()
        else:
            reader.start()
            cq.late = [wc(1)]
            cq.add(wc(0))  # wakes the reader: it polls 0, then the empty poll lands 1
        try:
            await asyncio.wait_for(both, 5)
        except TimeoutError:
            pytest.fail(f"completions {cq.landed} landed after an empty poll; the reader delivered only {got}")
        assert got == [0, 1]
        assert cq.late == [] and cq.landed == ([0, 1] if window == "start" else [1])
        assert reader.statistics().completions == 2
    finally:
        reader.close()
        cq.close()


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


async def test_a_second_start_is_an_error() -> None:
    """Two starts would add the fd twice (or two timers): refused, and the first keeps working."""
    loop = asyncio.get_running_loop()
    cq = Queue()
    seen: list[int] = []
    reader = CompletionReader(loop, cq, lambda wcs: seen.extend(w.wr_id for w in wcs))
    reader.start()
    try:
        with pytest.raises(RuntimeError, match=r"^this completion reader was already started$"):
            reader.start()
        cq.add(wc(1))
        assert reader.drain() == 1 and seen == [1]
    finally:
        reader.close()
        cq.close()


class Timer:
    """A timer the test fires by hand."""

    def __init__(self, delay: float, callback: Callable[[], None]) -> None:
        self.delay = delay
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Timers:
    """The parts of an event loop a reader uses, recorded: the fallback's timers fire when the test says."""

    def __init__(self) -> None:
        self.timers: list[Timer] = []
        self.readers: list[int] = []
        self.removed: list[int] = []

    def call_later(self, delay: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        self.timers.append(Timer(delay, callback))
        return cast(asyncio.TimerHandle, self.timers[-1])

    def add_reader(self, fd: int, callback: Callable[[], None]) -> None:
        self.readers.append(fd)

    def remove_reader(self, fd: int) -> None:
        self.removed.append(fd)

    def fire(self) -> float:
        """Run the one live timer; its delay."""
        live = [t for t in self.timers if not t.cancelled]
        assert len(live) == 1, live
        self.timers.clear()
        live[0].callback()
        return live[0].delay


class NoFd(Queue):
    def fileno(self) -> int:
        return -1


def fallback(timers: Timers, cq: Queue, batches: list[int], **kwargs: Any) -> CompletionReader:
    loop = cast(asyncio.AbstractEventLoop, timers)
    return CompletionReader(loop, cq, lambda wcs: batches.append(len(wcs)), **kwargs)


async def test_fallback_polls_back_off_to_the_ceiling_and_come_back_with_work(caplog: pytest.LogCaptureFixture) -> None:
    """Without a channel fd, nothing polls until work is posted; then every min_interval while
    completions come, doubling while idle up to max_interval, and min_interval again at the next one."""
    timers, cq = Timers(), NoFd()
    batches: list[int] = []
    reader = fallback(timers, cq, batches, min_interval=0.001, max_interval=0.006)
    with caplog.at_level(logging.WARNING, logger="moriio_async"):
        reader.start()
    assert [r.getMessage() for r in caplog.records] == [
        "completion channel has no fd (pyverbs < 57): polling the CQ from the event loop; "
        "upgrade rdma-core/pyverbs to 57+ for event-driven completions"
    ]
    assert timers.timers == [] and timers.readers == []
    reader.kick()
    reader.kick()  # a poll is already coming: not a second timer
    assert len(timers.timers) == 1
    assert [timers.fire() for _ in range(5)] == [0.001, 0.002, 0.004, 0.006, 0.006]
    cq.add(wc(1))
    assert timers.fire() == 0.006 and batches == [1]  # the poll that found it: the next one is soon
    assert timers.fire() == 0.001
    assert timers.fire() == 0.002
    reader.kick()  # work posted while backed off: the back-off starts over from min_interval
    assert timers.fire() == 0.004
    assert timers.fire() == 0.002
    stats = reader.statistics()
    assert (stats.wakeups, stats.completions, stats.largest_batch, stats.fallback_polling) == (10, 1, 1, True)
    reader.close()
    assert all(t.cancelled for t in timers.timers) and timers.removed == []
    reader.kick()  # closed: nothing more is scheduled
    assert all(t.cancelled for t in timers.timers)
    cq.close()


async def test_fallback_defaults_and_idle_stop() -> None:
    """The defaults: 0.2 ms while busy, backing off to 10 ms; a reader with no work in flight stops polling."""
    timers, cq = Timers(), NoFd()
    batches: list[int] = []
    work = [True]
    reader = fallback(timers, cq, batches, has_work=lambda: work[0])
    reader.start()
    reader.kick()
    delays = [timers.fire() for _ in range(8)]
    assert delays == pytest.approx([0.0002, 0.0004, 0.0008, 0.0016, 0.0032, 0.0064, 0.01, 0.01])
    work[0] = False
    timers.fire()
    assert timers.timers == []
    reader.kick()
    assert [t.delay for t in timers.timers] == [0.0002]
    reader.close()
    cq.close()


async def test_drain_polls_in_batches_until_empty() -> None:
    timers, cq = Timers(), Queue()
    batches: list[int] = []
    reader = fallback(timers, cq, batches)
    reader.start()
    assert timers.readers == [cq.fileno()]
    for i in range(150):
        cq.add(wc(i))
    assert reader.drain() == 150 and batches == [64, 64, 22]
    small = fallback(Timers(), cq, batches, batch=4)
    for i in range(10):
        cq.add(wc(i))
    assert small.drain() == 10 and batches[3:] == [4, 4, 2]
    assert reader.drain() == 0
    reader.kick()  # a channel fd: no timer, ever
    assert timers.timers == []
    stats = reader.statistics()
    assert (stats.wakeups, stats.completions, stats.largest_batch, stats.fallback_polling) == (0, 150, 64, False)
    reader.close()
    assert timers.removed == [cq.fileno()]
    cq.close()


async def test_one_wakeup_per_channel_event() -> None:
    """Each event is consumed before the reader re-arms: an event left unread would keep the fd readable
    and wake the reader on every loop iteration with nothing to poll."""
    loop = asyncio.get_running_loop()
    cq = Queue()
    seen: list[int] = []
    reader = CompletionReader(loop, cq, lambda wcs: seen.extend(w.wr_id for w in wcs))
    reader.start()
    try:
        for i in range(3):
            cq.add(wc(i))
            for _ in range(20):
                await asyncio.sleep(0)
            assert seen == list(range(i + 1))
            assert reader.statistics().wakeups == i + 1
    finally:
        reader.close()
        cq.close()


async def test_a_reader_closed_before_it_started_touches_nothing() -> None:
    timers, cq = Timers(), Queue()
    reader = fallback(timers, cq, [])
    reader.close()
    reader.close()
    assert (timers.readers, timers.removed, timers.timers) == ([], [], [])
    stats = reader.statistics()
    assert (stats.wakeups, stats.completions, stats.largest_batch) == (0, 0, 0)
    cq.close()


async def test_fd_zero_is_a_channel_fd_like_any_other() -> None:
    class FdZero(Queue):
        def fileno(self) -> int:
            return 0

    timers, cq = Timers(), FdZero()
    reader = fallback(timers, cq, [])
    reader.start()
    reader.kick()
    assert (timers.readers, timers.timers, reader.statistics().fallback_polling) == ([0], [], False)
    reader.close()
    assert timers.removed == [0]
    cq.close()
