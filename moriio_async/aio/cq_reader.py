"""Draining a completion queue from the event loop, woken by its completion channel.

The order before the reader goes idle is the whole point: re-arm, and only
then poll until the queue is empty. A completion that lands after the re-arm
raises a new event; one that landed before it is found by the poll. Polling
last without arming first would leave a window where a completion arrives,
no event is raised, and nothing ever looks again.

While completions keep coming the reader does not re-arm: a wakeup that found
completions polls again on the loop's next pass (``call_soon``), and arms,
then polls once more, only when a poll finds the queue empty. Completions that
land meanwhile (a single read or write posted by the task the last batch woke)
are found by that poll, with no channel event: no eventfd write on the NIC's
side, no ``epoll`` wakeup and event read on this side, per operation.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from ..backends.base import CompletionQueue
from ..work import WorkCompletion

__all__ = ["CompletionReader", "ReaderStatistics"]

log = logging.getLogger("moriio_async")

Dispatch = Callable[[list[WorkCompletion]], None]


@dataclass(frozen=True, slots=True)
class ReaderStatistics:
    wakeups: int
    """Channel events handled (or timer polls, in fallback mode)."""
    completions: int
    largest_batch: int
    fallback_polling: bool


class CompletionReader:
    """One completion queue, one ``loop.add_reader``, many transfers resolved per wakeup.

    Without a channel fd (pyverbs older than 57) it falls back to polling on
    the loop's timer: every ``min_interval`` while completions keep coming,
    backing off to ``max_interval`` when idle, and not at all when
    ``has_work()`` says nothing is in flight.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        cq: CompletionQueue,
        dispatch: Dispatch,
        *,
        batch: int = 64,
        has_work: Callable[[], bool] = lambda: True,
        min_interval: float = 0.0002,
        max_interval: float = 0.01,
    ) -> None:
        self._loop = loop
        self._cq = cq
        self._dispatch = dispatch
        self._batch = batch
        self._has_work = has_work
        self._min_interval = min_interval
        self._max_interval = max_interval
        self._interval = min_interval
        self._timer: asyncio.TimerHandle | None = None
        self._again: asyncio.Handle | None = None
        """The poll on the loop's next pass while completions keep coming (the queue is not armed then)."""
        self._fd = -1
        self._closed = False
        self._started = False
        self._wakeups = 0
        self._completions = 0
        self._largest = 0

    def start(self) -> None:
        """Watch the queue's channel fd (or poll on a timer without one). A second call is an error."""
        if self._started:
            raise RuntimeError("this completion reader was already started")
        self._started = True
        self._fd = self._cq.fileno()
        if self._fd >= 0:
            self._cq.req_notify()
            self._loop.add_reader(self._fd, self._on_readable)
        else:
            log.warning(
                "completion channel has no fd (pyverbs < 57): polling the CQ from the event loop; "
                "upgrade rdma-core/pyverbs to 57+ for event-driven completions"
            )
        self.drain()

    def _on_readable(self) -> None:
        self._wakeups += 1
        self._cq.get_event()
        if self._again is None:
            self._poll_again()

    def _poll_again(self) -> None:
        """Poll; if that found completions, poll again on the next pass, else arm and poll a last time."""
        self._again = None
        if self._closed:
            return
        if not self.drain():
            self._cq.req_notify()
            if not self.drain():
                return
        self._again = self._loop.call_soon(self._poll_again)

    def drain(self) -> int:
        """Poll until the queue is empty, dispatching each batch; return how many completions."""
        total = 0
        while True:
            wcs = self._cq.poll(self._batch)
            if not wcs:
                break
            total += len(wcs)
            self._largest = max(self._largest, len(wcs))
            self._dispatch(wcs)
        self._completions += total
        return total

    @property
    def polls_by_timer(self) -> bool:
        """True until started on a channel fd (from then on ``kick`` does nothing)."""
        return self._fd < 0

    def kick(self) -> None:
        """Work was posted: in fallback mode, make sure a poll is coming soon."""
        if self._fd >= 0 or self._closed:
            return
        self._interval = self._min_interval
        if self._timer is None:
            self._timer = self._loop.call_later(self._interval, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._wakeups += 1
        got = self.drain()
        self._interval = self._min_interval if got else min(self._interval * 2, self._max_interval)
        if not self._closed and self._has_work():
            self._timer = self._loop.call_later(self._interval, self._on_timer)

    def statistics(self) -> ReaderStatistics:
        return ReaderStatistics(self._wakeups, self._completions, self._largest, self._fd < 0)

    def close(self) -> None:
        """Stop watching; safe to call twice. The queue itself belongs to the caller."""
        if self._closed:
            return
        self._closed = True
        if self._fd >= 0:
            self._loop.remove_reader(self._fd)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._again is not None:
            self._again.cancel()
            self._again = None
