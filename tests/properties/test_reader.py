"""The completion reader's wakeup order, as a property: whatever the schedule of completions, a reader
left alone (no drain from outside, no timer) delivers every completion that reached its queue.

The schedules include the window the order exists for (``aio/cq_reader.py``): a completion landing the
moment the reader's poll found the queue empty, before the reader's callback returns, and, at start,
before ``start()`` returns. Get the event, re-arm, poll covers it (the landing raises an event); poll
then re-arm, or a first poll before the first arm, leaves that completion in the queue with no event to
come, and the property fails at that step.
"""

from __future__ import annotations

import asyncio
import os
from collections import deque

from hypothesis import given
from hypothesis import strategies as st

from moriio_async.aio.cq_reader import CompletionReader
from moriio_async.backends.base import CompletionQueue
from moriio_async.status import Opcode, WcStatus
from moriio_async.work import WorkCompletion

IDLE = 0.5
"""Seconds of real time a step's completions get to arrive; a correct reader needs a few loop iterations."""


class ScheduledQueue(CompletionQueue):
    """A completion queue by the contract in backends/base.py (an eventfd channel: after ``req_notify``
    the next completion added makes it readable, once), fed by the schedule: ``add`` now, or ``late``,
    landing one at each poll that finds the queue empty (just after the poll, before its caller goes on)."""

    def __init__(self) -> None:
        self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._armed = False
        self._entries: deque[WorkCompletion] = deque()
        self.late: deque[WorkCompletion] = deque()
        self.added = 0

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

    def add(self, n: int) -> None:
        for _ in range(n):
            self._entries.append(WorkCompletion(self.added, WcStatus.SUCCESS, Opcode.RDMA_WRITE, 1, 1))
            self.added += 1
            if self._armed:
                self._armed = False
                os.eventfd_write(self._fd, 1)

    def land_late(self, n: int) -> None:
        """``n`` completions, each landing right after a poll that found the queue empty."""
        self.late.extend(WorkCompletion(-1, WcStatus.SUCCESS, Opcode.RDMA_WRITE, 1, 1) for _ in range(n))

    def poll(self, max_entries: int = 64) -> list[WorkCompletion]:
        out = [self._entries.popleft() for _ in range(min(max_entries, len(self._entries)))]
        if not out and self.late:
            self.late.popleft()
            self.add(1)
        return out

    def close(self) -> None:
        os.close(self._fd)


step = st.tuples(st.integers(0, 70), st.integers(0, 3))
"""One step of a schedule: completions added at once (a wakeup), then how many land late, one per empty poll."""


@given(
    at_start=st.integers(0, 3),
    steps=st.lists(step, min_size=1, max_size=6),
    batch=st.sampled_from([1, 4, 64]),
)
async def test_a_reader_left_alone_delivers_every_completion_whatever_lands_after_its_last_poll(
    at_start: int, steps: list[tuple[int, int]], batch: int
) -> None:
    loop = asyncio.get_running_loop()
    cq = ScheduledQueue()
    got: list[int] = []

    def dispatch(wcs: list[WorkCompletion]) -> None:
        got.extend(w.wr_id for w in wcs)

    async def all_delivered(what: str) -> None:
        """Every completion added so far was dispatched, and still is a few loop iterations later (a late
        landing happens inside the reader's callback; the event it raises is handled in the next ones)."""
        give_up = loop.time() + IDLE
        quiet = 0
        while quiet < 3:
            await asyncio.sleep(0)
            quiet = quiet + 1 if len(got) == cq.added else 0
            if not quiet:
                if loop.time() > give_up:
                    raise AssertionError(
                        f"{what}: {cq.added - len(got)} of {cq.added} completions sit in the queue, no event to come"
                    )
                await asyncio.sleep(0.001)
        assert got == list(range(cq.added))  # each once, in the order they landed

    reader = CompletionReader(loop, cq, dispatch, batch=batch)
    try:
        cq.land_late(at_start)  # start()'s own drain finds the queue empty: these land in its window
        reader.start()
        await all_delivered("at start")
        for i, (now, late) in enumerate(steps):
            cq.land_late(late)
            cq.add(now)
            await all_delivered(f"step {i} ({now} added, {late} landing after empty polls)")
    finally:
        reader.close()
        cq.close()
