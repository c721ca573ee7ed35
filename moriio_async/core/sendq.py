"""Send-queue accounting for one queue pair, with no asyncio and no I/O.

The runtime, not the NIC, decides when a request may be posted, so a full
send queue is ordinary backpressure: requests wait here, in posting order,
until completions give slots back. The rules it keeps:

* A slot is held from posting until the completion that covers the request
  has been polled. On an RC pair completions come in order, so a signaled
  completion covers every earlier request on the pair.
* Only what needs a completion is signaled: the last request of each
  transfer (its owner wants to know), and one request in every ``depth // 4``
  so slots come back while a long transfer streams (an unsignaled run as long
  as the queue would hold every slot until the very end).
* After an error the pair posts nothing more. Requests still waiting here
  are flushed only once every posted one has completed, so flushes are still
  reported in posting order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from ..status import WcStatus

__all__ = ["Entry", "SendQueue"]

T = TypeVar("T")


@dataclass(slots=True)
class Entry(Generic[T]):
    """One work request's bookkeeping: its owner and what to post."""

    owner: T
    payload: object
    last_of_owner: bool
    wr_id: int = 0
    signaled: bool = False


class SendQueue(Generic[T]):
    """Waiting and in-flight requests of one queue pair."""

    def __init__(self, depth: int, first_wr_id: int = 1) -> None:
        if depth < 1:
            raise ValueError("send-queue depth must be >= 1")
        self.depth = depth
        self.signal_every = max(1, depth // 4)
        self.waiting: deque[Entry[T]] = deque()
        self.in_flight: deque[Entry[T]] = deque()
        self.failed = False
        self._next_wr_id = first_wr_id
        self._unsignaled_run = 0

    @property
    def free_slots(self) -> int:
        return self.depth - len(self.in_flight)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.in_flight

    def enqueue(self, entries: list[Entry[T]]) -> None:
        self.waiting.extend(entries)

    def take_postable(self) -> list[Entry[T]]:
        """Entries to post now, in order, with wr_id and signaling decided; they count as in flight."""
        if self.failed:
            return []
        n = min(self.free_slots, len(self.waiting))
        out: list[Entry[T]] = []
        for _ in range(n):
            entry = self.waiting.popleft()
            entry.wr_id = self._next_wr_id
            self._next_wr_id += 1
            self._unsignaled_run += 1
            entry.signaled = entry.last_of_owner or self._unsignaled_run >= self.signal_every
            if entry.signaled:
                self._unsignaled_run = 0
            self.in_flight.append(entry)
            out.append(entry)
        return out

    def complete(self, wr_id: int, status: WcStatus) -> list[tuple[Entry[T], WcStatus]]:
        """Account a polled completion: every in-flight entry up to ``wr_id`` is done.

        Earlier entries succeeded (their signaled successor says so); the
        named one ends with ``status``. An unknown wr_id covers nothing.
        """
        # wr_ids grow in posting order, so the in-flight deque is sorted by them.
        if not self.in_flight or not self.in_flight[0].wr_id <= wr_id <= self.in_flight[-1].wr_id:
            return []
        done: list[tuple[Entry[T], WcStatus]] = []
        while self.in_flight:
            entry = self.in_flight.popleft()
            if entry.wr_id == wr_id:
                done.append((entry, status))
                break
            # An earlier entry without a completion of its own: on an RC pair a later
            # completion implies it finished, successfully if this one did; once the
            # pair failed, the backend reports every entry itself, so this is a flush.
            done.append((entry, WcStatus.SUCCESS if not self.failed else WcStatus.WR_FLUSH_ERR))
        if status is not WcStatus.SUCCESS:
            self.failed = True
        return done

    def flush_waiting(self) -> list[tuple[Entry[T], WcStatus]]:
        """Once failed and drained, end every waiting entry with WR_FLUSH_ERR, in order."""
        if not self.failed or self.in_flight:
            return []
        out = [(e, WcStatus.WR_FLUSH_ERR) for e in self.waiting]
        self.waiting.clear()
        return out

    def fail_all_in_flight(self, status_of: Callable[[int], WcStatus]) -> list[tuple[Entry[T], WcStatus]]:
        """End every in-flight entry without a completion (the pair is gone for good)."""
        self.failed = True
        out = [(e, status_of(i)) for i, e in enumerate(self.in_flight)]
        self.in_flight.clear()
        return out

    def reset(self) -> None:
        """A fresh queue pair replaced the failed one: post again (only when idle)."""
        if self.in_flight:
            raise RuntimeError("reset with requests still in flight")
        self.failed = False
        self._unsignaled_run = 0
