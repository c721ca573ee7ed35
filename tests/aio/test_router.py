"""``aio.router.CompletionRouter`` on its own, over fake completion queues and channels: which channel
each completion reaches (per queue, by the tagged queue-pair number), the order of accounting and
posting, the transfer books, closing and the statistics."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest

from moriio_async.aio.router import TAG_SHIFT, CompletionRouter
from moriio_async.aio.transfer import Transfer
from moriio_async.backends.base import CompletionQueue
from moriio_async.status import Opcode, StatusCode, WcStatus
from moriio_async.work import WorkCompletion


class FakeCQ(CompletionQueue):
    def __init__(self, fd: int = -1) -> None:
        self.fd = fd
        self.queue: list[WorkCompletion] = []
        self.polls: list[int] = []

    def fileno(self) -> int:
        return self.fd

    def req_notify(self) -> None:
        pass

    def get_event(self) -> bool:
        return True

    def poll(self, max_entries: int = 64) -> list[WorkCompletion]:
        self.polls.append(max_entries)
        out = self.queue[:max_entries]
        del self.queue[:max_entries]
        return out

    def close(self) -> None:
        pass


class FakeChannel:
    def __init__(self, qp_num: int, log: list[Any], name: str) -> None:
        self.qp_num = qp_num
        self.log = log
        self.name = name

    def account(self, wc: WorkCompletion) -> None:
        self.log.append((self.name, wc.wr_id))

    def resume(self) -> None:
        self.log.append((self.name, "resume"))


class Pin:
    def __init__(self) -> None:
        self.unpins = 0

    def unpin(self) -> None:
        self.unpins += 1


def wc(wr_id: int, qp_num: int) -> WorkCompletion:
    return WorkCompletion(wr_id, WcStatus.SUCCESS, Opcode.RDMA_WRITE, 0, qp_num)


def transfer(loop: asyncio.AbstractEventLoop, tid: int = 1) -> Transfer:
    return Transfer(loop, tid, Opcode.RDMA_WRITE, "b", (0,), (0,), (8,))


def one_channel(loop: asyncio.AbstractEventLoop) -> tuple[CompletionRouter, FakeCQ, list[Any]]:
    """A router over one fake queue, with channel "a" on queue pair 3; and the list it logs into."""
    cq = FakeCQ()
    router = CompletionRouter(loop, cq)
    log: list[Any] = []
    router.attach(FakeChannel(3, log, "a"))  # type: ignore[arg-type]
    return router, cq, log


@pytest.fixture
def pipe_fd() -> Iterator[int]:
    r, w = os.pipe()
    yield r
    os.close(r)
    os.close(w)


async def test_completions_reach_their_channel_per_queue_by_tagged_number() -> None:
    loop = asyncio.get_running_loop()
    cq0, cq1 = FakeCQ(), FakeCQ()
    router = CompletionRouter(loop, cq0)
    router.add_queue(cq1)
    log: list[Any] = []
    a = FakeChannel(5, log, "a")
    b = FakeChannel((1 << TAG_SHIFT) | 5, log, "b")
    c = FakeChannel((1 << TAG_SHIFT) | 6, log, "c")
    for ch in (a, b, c):
        router.attach(ch)  # type: ignore[arg-type]
    cq0.queue = [wc(1, 5), wc(2, 6), wc(3, 5)]  # 6 is not a pair of the first queue: dropped
    cq1.queue = [wc(4, 5), wc(5, 6), wc(6, 7)]
    assert router.drain() == 6
    assert log == [("a", 1), ("a", 3), ("a", "resume"), ("b", 4), ("c", 5), ("b", "resume"), ("c", "resume")]
    assert router.statistics().channels == 3
    router.close()


async def test_every_completion_is_accounted_before_each_channel_resumes_once_in_first_seen_order() -> None:
    loop = asyncio.get_running_loop()
    cq = FakeCQ()
    router = CompletionRouter(loop, cq)
    log: list[Any] = []
    a, b = FakeChannel(1, log, "a"), FakeChannel(2, log, "b")
    router.attach(a)  # type: ignore[arg-type]
    router.attach(b)  # type: ignore[arg-type]
    cq.queue = [wc(1, 2), wc(2, 2), wc(3, 1), wc(4, 2), wc(5, 1)]
    assert router.drain() == 5
    assert log == [("b", 1), ("b", 2), ("a", 3), ("b", 4), ("a", 5), ("b", "resume"), ("a", "resume")]
    router.close()


async def test_detach_removes_only_the_channel_attached_now() -> None:
    loop = asyncio.get_running_loop()
    cq0, cq1 = FakeCQ(), FakeCQ()
    router = CompletionRouter(loop, cq0)
    router.add_queue(cq1)
    log: list[Any] = []
    old, new = FakeChannel(9, log, "old"), FakeChannel(9, log, "new")
    tagged = FakeChannel((1 << TAG_SHIFT) | 9, log, "tagged")
    router.attach(old)  # type: ignore[arg-type]
    router.attach(new)  # type: ignore[arg-type]  # the pair was replaced: same number
    router.attach(tagged)  # type: ignore[arg-type]
    router.detach(old)  # type: ignore[arg-type]
    assert router.statistics().channels == 2
    cq0.queue = [wc(1, 9)]
    cq1.queue = [wc(2, 9)]
    router.drain()
    assert log == [("new", 1), ("new", "resume"), ("tagged", 2), ("tagged", "resume")]
    router.detach(tagged)  # type: ignore[arg-type]
    router.detach(new)  # type: ignore[arg-type]
    assert router.statistics().channels == 0
    cq0.queue = [wc(3, 9)]
    cq1.queue = [wc(4, 9)]
    assert router.drain() == 2
    assert len(log) == 4
    router.close()


async def test_the_readers_poll_in_batches_of_the_routers_size() -> None:
    loop = asyncio.get_running_loop()
    cq = FakeCQ()
    router = CompletionRouter(loop, cq, batch=2)
    log: list[Any] = []
    router.attach(FakeChannel(1, log, "a"))  # type: ignore[arg-type]
    cq.queue = [wc(i, 1) for i in range(5)]
    assert router.drain() == 5
    assert cq.polls == [2, 2, 2, 2]
    stats = router.statistics()
    assert (stats.reader.completions, stats.reader.largest_batch, stats.drains) == (5, 2, 1)
    default = FakeCQ()
    CompletionRouter(loop, default).drain()
    assert default.polls == [64]
    router.close()


async def test_start_drains_and_add_queue_after_start_is_refused() -> None:
    loop = asyncio.get_running_loop()
    router, cq, log = one_channel(loop)
    cq.queue = [wc(1, 3)]
    router.start()
    assert log == [("a", 1), ("a", "resume")]
    with pytest.raises(RuntimeError, match=r"^add_queue after start$"):
        router.add_queue(FakeCQ())
    assert router.statistics().drains == 0  # the readers' own drains are not counted
    router.close()


async def test_close_dispatches_what_is_queued_once_then_drains_nothing() -> None:
    loop = asyncio.get_running_loop()
    router, cq, log = one_channel(loop)
    assert router.closed is False
    router.begin_close()
    assert router.closed
    cq.queue = [wc(1, 3)]
    assert router.drain() == 1  # begun closing: completions still flow
    cq.queue = [wc(2, 3)]
    router.close()
    assert router.closed
    assert log == [("a", 1), ("a", "resume"), ("a", 2), ("a", "resume")]
    cq.queue = [wc(3, 3)]
    router.close()  # a second close polls nothing
    assert router.drain() == 0
    assert cq.queue == [wc(3, 3)]
    assert router.statistics().drains == 1
    fresh = CompletionRouter(loop, FakeCQ())
    fresh.close()
    assert fresh.closed


async def test_transfer_ids_count_from_one() -> None:
    router = CompletionRouter(asyncio.get_running_loop(), FakeCQ())
    assert [router.next_transfer_id() for _ in range(3)] == [1, 2, 3]
    assert CompletionRouter(asyncio.get_running_loop(), FakeCQ()).next_transfer_id() == 1


async def test_a_tracked_transfer_is_outstanding_until_it_ends_then_unpinned_once() -> None:
    loop = asyncio.get_running_loop()
    router = CompletionRouter(loop, FakeCQ())
    t1, t2 = transfer(loop, 1), transfer(loop, 2)
    p1, p2 = Pin(), Pin()
    router.track(t1, p1)
    router.track(t2, p2)
    assert router.outstanding == 2
    assert router.outstanding_transfers() == [t1, t2]
    assert router.statistics().outstanding == 2
    t1.fail(StatusCode.ERR_BAD_STATE, "x")
    assert (p1.unpins, p2.unpins, router.outstanding) == (1, 0, 1)
    assert router.outstanding_transfers() == [t2]
    t1.fail(StatusCode.ERR_BAD_STATE, "again")  # a latched transfer ends once: nothing more to release
    assert (p1.unpins, router.outstanding) == (1, 1)
    t2.start(1)
    t2.settle(1, WcStatus.SUCCESS)
    assert (p2.unpins, router.outstanding, router.outstanding_transfers()) == (1, 0, [])


async def test_fallback_polling_finds_a_kicked_completion() -> None:
    loop = asyncio.get_running_loop()
    router, cq, log = one_channel(loop)
    router.start()
    t = transfer(loop)
    router.track(t, Pin())
    cq.queue = [wc(1, 3)]
    router.kick()
    for _ in range(200):
        await asyncio.sleep(0.001)
        if log:
            break
    assert log == [("a", 1), ("a", "resume")]
    stats = router.statistics()
    assert stats.reader.fallback_polling
    assert stats.reader.wakeups >= 1
    router.close()


async def test_statistics_add_up_the_readers(pipe_fd: int) -> None:
    loop = asyncio.get_running_loop()
    cq0, cq1, cq2 = FakeCQ(pipe_fd), FakeCQ(), FakeCQ(pipe_fd)
    router = CompletionRouter(loop, cq0)
    router.add_queue(cq1)
    log: list[Any] = []
    router.attach(FakeChannel(1, log, "a"))  # type: ignore[arg-type]
    router.attach(FakeChannel((1 << TAG_SHIFT) | 1, log, "b"))  # type: ignore[arg-type]
    router.start()
    cq0.queue = [wc(1, 1), wc(2, 1), wc(3, 1)]
    cq1.queue = [wc(4, 1)]
    assert router.drain() == 4
    cq1.queue = [wc(5, 1), wc(6, 1)]
    assert router.drain() == 2
    s = router.statistics()
    assert (s.channels, s.outstanding, s.drains) == (2, 0, 2)
    assert (s.reader.wakeups, s.reader.completions, s.reader.largest_batch) == (0, 6, 3)
    assert s.reader.fallback_polling  # one of the two queues has no fd
    router.close()
    only_fd = CompletionRouter(loop, cq2)
    only_fd.start()
    assert not only_fd.statistics().reader.fallback_polling
    only_fd.close()


async def test_fallback_polling_goes_on_while_a_transfer_is_outstanding() -> None:
    loop = asyncio.get_running_loop()
    router, cq, log = one_channel(loop)
    router.start()
    router.track(transfer(loop), Pin())
    router.kick()
    for _ in range(500):  # the first timer poll finds nothing
        await asyncio.sleep(0.001)
        if router.statistics().reader.wakeups:
            break
    assert router.statistics().reader.wakeups >= 1 and not log
    cq.queue = [wc(1, 3)]  # no kick: found by the next poll, because a transfer is outstanding
    for _ in range(1000):
        await asyncio.sleep(0.001)
        if log:
            break
    assert log == [("a", 1), ("a", "resume")]
    router.close()


class Timer:
    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class ManualTimers:
    """The parts of an event loop a reader uses, without one: its timers fire when the test says."""

    def __init__(self) -> None:
        self.timers: list[Timer] = []

    def call_later(self, delay: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        self.timers.append(Timer(callback))
        return cast(asyncio.TimerHandle, self.timers[-1])

    def live(self) -> int:
        return sum(not t.cancelled for t in self.timers)

    def fire(self) -> None:
        live = [t for t in self.timers if not t.cancelled]
        self.timers.clear()
        for t in live:
            t.callback()


async def test_fallback_polling_stops_once_no_transfer_is_outstanding() -> None:
    """The readers ask the router whether anything is in flight: polling goes on while a transfer is
    outstanding and stops once the last one ended (a kick starts it again)."""
    timers = ManualTimers()
    cq = FakeCQ()  # no channel fd: the readers poll on the loop's timer
    router = CompletionRouter(cast(asyncio.AbstractEventLoop, timers), cq)
    log: list[Any] = []
    router.attach(FakeChannel(3, log, "a"))  # type: ignore[arg-type]
    router.start()
    t = transfer(asyncio.get_running_loop())
    router.track(t, Pin())
    router.kick()
    assert timers.live() == 1
    for _ in range(3):  # nothing found, a transfer is outstanding: the next poll is coming
        timers.fire()
        assert timers.live() == 1
    t.fail(StatusCode.ERR_BAD_STATE, "x")
    cq.queue = [wc(1, 3)]
    timers.fire()  # this poll finds the completion; nothing is outstanding now: no next poll
    assert (timers.live(), log) == (0, [("a", 1), ("a", "resume")])
    assert router.statistics().reader.wakeups == 4
    router.kick()
    assert timers.live() == 1
    router.close()
    assert timers.live() == 0
