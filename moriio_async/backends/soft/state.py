"""The locked state every software NIC's queue pair shares: slots, posted spans, in-order flushes, ERR.

A software pair (tcp, cma) keeps its posted requests as spans of whole
batches, never as request objects, and completes them in posting order: the
NIC threads complete successes at the head, and entering ERR gives the oldest
outstanding request its status and flushes every later one. This class holds
what both NICs do alike; each backend's ``pairstate.py`` adds its own threads'
fields and implements ``quiesce_locked``, the wait that makes a flush safe.

The lock rules every software pair follows (a backend's ``pairstate.py``
lists its own further locks, in one place, with these):

* ``lock`` guards every field. The poster (``admit_locked``), the NIC
  threads, ``to_error`` and ``close`` take it; nothing blocks while holding
  it, except that entering ERR waits in ``quiesce_locked`` for the backend's
  copy lock (a NIC thread moving local bytes: the wait ends with that call,
  never waits on the peer). Why: no byte lands in, or leaves, local memory
  once a flush for its request is visible, so a caller that sees the flush
  may reuse or deregister the buffer at once.
* Completions are pushed to the CQ under ``lock`` (the CQ's lock nests
  inside): pushing in the order they are made is what keeps them in posting
  order whichever thread makes them.
* Slots: ``posted`` is written under ``lock``; ``released`` by the CQ's
  poller, under the CQ's lock (``release_slots``); the poster reads their
  difference. Each has one writer, so neither needs the other's lock.
* Only the pair-state modules assign these fields: the queue pair and the NIC
  threads call its methods, so each field's writers are found in one file.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from typing import Generic, TypeVar

import numpy as np

from ...status import Opcode, WcStatus
from ...work import WorkBatch, WorkCompletion
from ..base import QpState
from .cq import SoftCompletionQueue
from .pair import Completions, fold_successes

__all__ = ["SoftPairState", "Span"]

_OPCODES = {int(o): o for o in Opcode}
_ERR = QpState.ERR
_FLUSH = WcStatus.WR_FLUSH_ERR


class Span:
    """Posted requests ``pos:`` of ``batch`` that no NIC thread has taken (or completed) yet;
    request ``i`` is posting number ``seq + i``."""

    __slots__ = ("batch", "cuts", "ends", "pos", "seq")

    def __init__(self, batch: WorkBatch, seq: int) -> None:
        self.batch = batch
        self.seq = seq
        self.pos = 0
        self.cuts: list[int] | None = None  # where the opcode changes, then len(batch)
        self.ends: np.ndarray | None = None  # cumulative request lengths

    def cut(self, max_bytes: int, max_requests: int) -> int:
        """Where the chunk starting at ``pos`` ends: one opcode, at most ``max_requests`` requests
        and about ``max_bytes`` of payload (at least one request)."""
        batch, pos = self.batch, self.pos
        n = len(batch)
        if n - pos == 1:
            return n
        if self.cuts is None:
            self.cuts = [*(np.flatnonzero(np.diff(batch.opcode)) + 1).tolist(), n]
            self.ends = np.cumsum(batch.length)
        assert self.ends is not None
        run_end = next(c for c in self.cuts if c > pos)
        before = int(self.ends[pos - 1]) if pos else 0
        by_bytes = int(np.searchsorted(self.ends, before + max_bytes, side="right"))
        return max(pos + 1, min(run_end, pos + max_requests, by_bytes))

    def payload_to(self, end: int) -> int:
        """The payload bytes of requests ``pos:end`` (after ``cut`` made the sums)."""
        assert self.ends is not None
        return int(self.ends[end - 1]) - (int(self.ends[self.pos - 1]) if self.pos else 0)


S = TypeVar("S", bound=Span)


class SoftPairState(Generic[S]):
    """One software queue pair's posted and outstanding requests, its counters and its state."""

    def __init__(self, qp_num: int, cq: SoftCompletionQueue, span: type[S]) -> None:
        self.qp_num = qp_num
        self.cq = cq
        self.lock = threading.Lock()
        self.state = QpState.INIT
        self._span = span
        self.pending: deque[S] = deque()
        self.posted = 0
        self.released = 0
        self.uncovered = 0  # successful unsignaled requests the next completion covers
        self.closed = False

    # -- the queue pair's calls (under ``lock``) ----------------------------------------

    def used_locked(self) -> int:
        """Send-queue slots taken: posted, and not yet released by a polled completion."""
        return self.posted - self.released

    def admit_locked(self, batch: WorkBatch) -> bool:
        """Accept a checked batch that fits the send queue; False when it was flushed at once
        (in ERR, as verbs does), True when it waits in ``pending``."""
        seq = self.posted
        self.posted = seq + len(batch)
        if self.state == _ERR:
            self._push(self._flushes(batch, 0, _FLUSH, 0))
            return False
        self.pending.append(self._span(batch, seq))
        return True

    def ready_locked(self) -> None:
        """The queue pair is connected (active side) or expects its peer (passive side)."""
        self.state = QpState.RTS

    def passive_ended(self) -> None:
        """The passive pair's connection ended: the pair is unusable from now on (it posts
        nothing, so there is nothing to flush)."""
        with self.lock:
            self.state = _ERR

    def close_locked(self) -> bool:
        """Mark the pair closed and flush what is outstanding; False if it was closed already."""
        if self.closed:
            return False
        self.closed = True
        self.fail_locked(_FLUSH, 0)
        return True

    # -- completing -------------------------------------------------------------------

    def release_slots(self, n: int) -> None:
        self.released += n

    def succeeded_locked(self, batch: WorkBatch, a: int, b: int) -> None:
        """Requests ``a:b`` of ``batch`` succeeded, in order: push the completions they make."""
        out, self.uncovered = fold_successes(batch, a, b, self.uncovered, self.qp_num)
        if out:
            self.cq.push_many(out, self)

    # -- the error state ----------------------------------------------------------------

    def fail(self, status: WcStatus, vendor: int) -> None:
        with self.lock:
            self.fail_locked(status, vendor)

    def fail_locked(self, status: WcStatus, vendor: int) -> None:
        """Enter ERR: the oldest outstanding request gets ``status``, every later one WR_FLUSH_ERR."""
        if self.state == _ERR:
            return
        self.state = _ERR
        self.quiesce_locked()
        out: Completions = []
        for batch, start, stop in self.unfinished_locked():
            out += self._flushes(batch, start, status, vendor, stop)
            if out:
                status, vendor = _FLUSH, 0
        self.clear_locked()
        self._push(out)

    def quiesce_locked(self) -> None:
        """Wake the NIC threads and wait until none moves local bytes (the state is ERR already).
        Each backend says how; see the lock rules above for why."""
        raise NotImplementedError

    def unfinished_locked(self) -> Iterator[tuple[WorkBatch, int, int | None]]:
        """What is outstanding, oldest first: (batch, first request, end or None for the rest)."""
        for span in self.pending:
            yield span.batch, span.pos, None

    def clear_locked(self) -> None:
        """Forget what is outstanding (after its flushes were made)."""
        self.pending.clear()

    def _flushes(
        self, batch: WorkBatch, start: int, status: WcStatus, vendor: int, stop: int | None = None
    ) -> Completions:
        """Completions for requests ``start:stop``: the first with ``status``, the rest flushed."""
        out: Completions = []
        first, qp_num = batch.wr_id, self.qp_num
        for i, op in enumerate(batch.opcode[start:stop].tolist(), start):
            out.append((WorkCompletion(first + i, status, _OPCODES[op], 0, qp_num, vendor), self.uncovered + 1))
            self.uncovered = 0
            status, vendor = _FLUSH, 0
        return out

    def _push(self, out: Completions) -> None:
        if out:
            self.cq.push_many(out, self)
