"""Send-queue accounting for one queue pair, with no asyncio and no I/O, in spans not entries.

The runtime, not the NIC, decides when a request may be posted, so a full
send queue is ordinary backpressure: requests wait here, in posting order,
until completions give slots back. State is kept per *span* (one owner's run
of consecutive requests), never per request, so a transfer of a thousand
work requests costs a handful of Python operations here. The rules it keeps:

* A slot is held from posting until the completion that covers the request
  has been polled. On an RC pair completions come in order, so a signaled
  completion covers every earlier request on the pair.
* Only what needs a completion is signaled: the last request of each owner
  (its owner wants to know), and one request in every ``depth // 4`` so
  slots come back while a long transfer streams (an unsignaled run as long as
  the queue would hold every slot until the very end).
* After an error the pair posts nothing more. Requests still waiting here
  are flushed only once every posted one has completed, so flushes are still
  reported in posting order.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import numpy.typing as npt

from ..status import WcStatus

__all__ = ["LAST_ONLY", "Chunk", "SendQueue", "Settled"]

T = TypeVar("T")

Settled = tuple[T, int, WcStatus]
"""``count`` requests of ``owner`` ended with ``status`` (in posting order)."""

LAST_ONLY = np.ones(1, dtype=np.bool_)
"""The signal flags of a one-request chunk that ends its owner: signaled."""
LAST_ONLY.flags.writeable = False


_SHORT = 16
_LAST_ONLY: dict[int, npt.NDArray[np.bool_]] = {1: LAST_ONLY}


def _last_only(n: int) -> npt.NDArray[np.bool_]:
    """Signal flags of ``n`` requests with only the last one signaled (shared, read-only)."""
    got = _LAST_ONLY.get(n)
    if got is None:
        got = np.zeros(n, dtype=np.bool_)
        got[-1] = True
        got.flags.writeable = False
        _LAST_ONLY[n] = got
    return got


@dataclass(slots=True)  # not frozen: a frozen field costs an object.__setattr__, on every post
class Chunk(Generic[T]):
    """Requests ``start:stop`` of ``owner`` to post now as wr_ids ``wr_id...``, with their signal flags."""

    owner: T
    start: int
    stop: int
    wr_id: int
    signaled: npt.NDArray[np.bool_]


class _Span(Generic[T]):
    """Waiting: requests ``pos:end`` of ``owner``. In flight: ``end - pos`` requests from wr_id ``pos``."""

    __slots__ = ("end", "owner", "pos")

    def __init__(self, owner: T, pos: int, end: int) -> None:
        self.owner = owner
        self.pos = pos
        self.end = end


class SendQueue(Generic[T]):
    """Waiting and in-flight requests of one queue pair, as spans."""

    def __init__(self, depth: int, first_wr_id: int = 1) -> None:
        if depth < 1:
            raise ValueError("send-queue depth must be >= 1")
        self.depth = depth
        self.signal_every = max(1, depth // 4)
        self.failed = False
        self._waiting: deque[_Span[T]] = deque()
        self._in_flight: deque[_Span[T]] = deque()
        self._n_waiting = 0
        self._n_in_flight = 0
        self._next_wr_id = first_wr_id
        self._unsignaled_run = 0

    @property
    def free_slots(self) -> int:
        return self.depth - self._n_in_flight

    @property
    def in_flight(self) -> int:
        """Requests posted and not yet covered by a polled completion."""
        return self._n_in_flight

    @property
    def waiting(self) -> int:
        """Requests queued here, not yet posted."""
        return self._n_waiting

    @property
    def idle(self) -> bool:
        return not self._n_waiting and not self._n_in_flight

    def enqueue(self, owner: T, count: int) -> None:
        """Queue ``count`` requests of ``owner``, after everything queued before."""
        if count < 1:
            raise ValueError("an owner queues at least one request")
        self._waiting.append(_Span(owner, 0, count))
        self._n_waiting += count

    def post_one(self, owner: T) -> int | None:
        """An owner of one request, posted at once if nothing waits and a slot is free: its wr_id (its
        signal flags are ``LAST_ONLY``), exactly as ``enqueue(owner, 1)`` then ``take_postable()``
        would post it. None, having done nothing, otherwise (then ``enqueue`` it)."""
        if self._waiting or self.failed or self._n_in_flight >= self.depth:
            return None
        wr_id = self._next_wr_id
        self._next_wr_id = wr_id + 1
        self._in_flight.append(_Span(owner, wr_id, wr_id + 1))
        self._n_in_flight += 1
        self._unsignaled_run = 0
        return wr_id

    def take_postable(self) -> list[Chunk[T]]:
        """Chunks to post now, in order, with wr_ids and signaling decided; they count as in flight."""
        if self.failed:
            return []
        free = self.depth - self._n_in_flight
        out: list[Chunk[T]] = []
        every = self.signal_every
        while free > 0 and self._waiting:
            item = self._waiting[0]
            owner, start, total = item.owner, item.pos, item.end
            take = min(free, total - start)
            stop = start + take
            last = stop == total
            run = self._unsignaled_run
            if take == 1 and last:
                signaled = LAST_ONLY
                self._unsignaled_run = 0
            elif last and take <= _SHORT and (run + take) // every == run // every:
                # A short owner's last requests, no multiple of ``every`` among them: only the last is signaled.
                signaled = _last_only(take)
                self._unsignaled_run = 0
            else:
                signaled = (np.arange(run + 1, run + take + 1) % every) == 0
                if last:
                    signaled[-1] = True
                self._unsignaled_run = 0 if signaled[-1] else (run + take) % every
            wr_id = self._next_wr_id
            self._next_wr_id += take
            out.append(Chunk(owner, start, stop, wr_id, signaled))
            self._in_flight.append(_Span(owner, wr_id, wr_id + take))
            self._n_in_flight += take
            self._n_waiting -= take
            free -= take
            if last:
                self._waiting.popleft()
            else:
                item.pos = stop
        return out

    def complete(self, wr_id: int, status: WcStatus) -> list[Settled[T]]:
        """Account a polled completion: every in-flight request up to ``wr_id`` is done.

        Earlier requests succeeded (their signaled successor says so); the
        named one ends with ``status``. An unknown wr_id covers nothing.
        """
        spans = self._in_flight
        if not spans or not spans[0].pos <= wr_id < spans[-1].end:
            return []
        # An earlier request without a completion of its own: on an RC pair a later completion
        # implies it finished, successfully if this one did; once the pair failed, the backend
        # reports every request itself, so this is a flush.
        earlier = WcStatus.SUCCESS if not self.failed else WcStatus.WR_FLUSH_ERR
        out: list[Settled[T]] = []
        while spans:
            span = spans[0]
            if span.end <= wr_id:
                spans.popleft()
                self._n_in_flight -= span.end - span.pos
                out.append((span.owner, span.end - span.pos, earlier))
                continue
            before = wr_id - span.pos
            if before:
                out.append((span.owner, before, earlier))
            out.append((span.owner, 1, status))
            if wr_id + 1 == span.end:
                spans.popleft()
            else:
                span.pos = wr_id + 1
            self._n_in_flight -= before + 1
            break
        if status is not WcStatus.SUCCESS:
            self.failed = True
        return out

    def flush_waiting(self) -> list[Settled[T]]:
        """Once failed and drained, end every waiting request with WR_FLUSH_ERR, in order."""
        if not self.failed or self._n_in_flight:
            return []
        return [(owner, count, WcStatus.WR_FLUSH_ERR) for owner, count in self.drop_waiting()]

    def drop_waiting(self) -> list[tuple[T, int]]:
        """Remove every waiting (unposted) request: (owner, count) in order."""
        out = [(span.owner, span.end - span.pos) for span in self._waiting]
        self._waiting.clear()
        self._n_waiting = 0
        return out

    def fail_all_in_flight(self) -> list[Settled[T]]:
        """End every in-flight request as flushed without a completion (the pair is gone for good)."""
        self.failed = True
        out = [(span.owner, span.end - span.pos, WcStatus.WR_FLUSH_ERR) for span in self._in_flight]
        self._in_flight.clear()
        self._n_in_flight = 0
        return out

    def reset(self) -> None:
        """A fresh queue pair replaced the failed one: post again (only when idle of in-flight work)."""
        if self._n_in_flight:
            raise RuntimeError("reset with requests still in flight")
        self.failed = False
        self._unsignaled_run = 0
