"""An initiator queue pair's locked state: posted spans, in-order completion, and the move to ERR.

One thread at a time executes the posted requests oldest first, a chunk at
a time: the worker, or the posting thread itself when it posted to an idle
pair (``running`` says one is at it; ``worker.py``). Completions are pushed
in posting order because only that thread completes successes, always for
the head span, and a failure flushes from the head on.

The lock rules, in one place (with the ones every software pair follows,
``soft/state.py``: ``lock`` guards every field, completions are pushed under
it, ``posted``/``released`` have one writer each):

* The poster (``admit_locked``), the worker (``complete_locked``), the reader
  (``fail``), ``to_error`` and ``close`` take ``lock``; ``work_cv`` (a
  condition on it) wakes the worker. ``running`` is set under ``lock`` by
  the thread that takes the head span and cleared by it when it stops: the
  worker waits while a poster runs its batch inline.
* ``copy_lock`` is held while bytes move (a window of a chunk) and while
  the reader applies a revocation. Entering ERR (``quiesce_locked``) waits
  for it, so no byte lands after a flush is visible; a revocation is
  acknowledged only after the copy in progress ended. Nothing takes ``lock``
  while holding it.
"""

from __future__ import annotations

import threading

import numpy as np

from ...work import WorkBatch
from ..base import QpState
from ..soft.cq import SoftCompletionQueue
from ..soft.state import SoftPairState
from ..soft.state import Span as SoftSpan
from .kernel import IOV_MAX

__all__ = ["PairState", "Span"]


class Span(SoftSpan):
    """Posted requests ``pos:`` of ``batch`` not yet completed (only the executing thread moves ``pos``)."""

    __slots__ = ("whole",)

    def __init__(self, batch: WorkBatch, seq: int) -> None:
        super().__init__(batch, seq)
        self.whole = False
        """The poster found the batch to be one chunk (one opcode, within every limit): no cutting."""

    def next_chunk(self, max_bytes: int) -> int:
        """Where the chunk from ``pos`` ends: one opcode, at most ``max_bytes`` (at least one request),
        at most IOV_MAX requests and IOV_MAX local SGEs."""
        if self.whole and not self.pos:
            return len(self.batch)
        end = self.cut(max_bytes, IOV_MAX)
        if end == self.pos + 1:
            return end
        starts = self.batch.sge_start
        by_sges = int(np.searchsorted(starts, int(starts[self.pos]) + IOV_MAX, side="right")) - 1
        return max(self.pos + 1, min(end, by_sges))


class PairState(SoftPairState[Span]):
    """One active queue pair's posted and outstanding requests, its counters and its state."""

    def __init__(self, qp_num: int, cq: SoftCompletionQueue) -> None:
        super().__init__(qp_num, cq, Span)
        self.work_cv = threading.Condition(self.lock)
        self.copy_lock = threading.Lock()
        self.running = False
        """A thread (the worker, or a poster inline) is executing the head span."""

    def admit_locked(self, batch: WorkBatch, whole: bool = False) -> bool:
        """Queue ``batch`` and wake the worker (False: flushed at once, in ERR). ``whole``: the batch is
        one chunk (``Span.whole``)."""
        queued = self._queue_locked(batch, whole)
        if queued:
            self.work_cv.notify()
        return queued

    def _queue_locked(self, batch: WorkBatch, whole: bool) -> bool:
        """Queue ``batch`` (False: flushed at once, in ERR), its span marked ``whole``; no thread woken."""
        queued = super().admit_locked(batch)
        if queued:
            self.pending[-1].whole = whole
        return queued

    def admit_inline_locked(self, batch: WorkBatch, whole: bool = False) -> bool:
        """Queue ``batch`` for the poster to run itself: True (and ``running`` set) when the pair is
        idle (RTS, nothing queued, no thread executing, every earlier request's completion polled);
        else it is queued for the worker (or flushed, in ERR) as ``admit_locked`` does, and False."""
        if self.state == QpState.RTS and not self.pending and not self.running and self.used_locked() == 0:
            self._queue_locked(batch, whole)
            self.running = True
            return True
        self.admit_locked(batch, whole)
        return False

    def take_head_locked(self) -> Span | None:
        """The head span, for the thread that holds ``running`` (None: nothing to do, or not RTS)."""
        return self.pending[0] if self.state == QpState.RTS and self.pending else None

    def stop_running_locked(self) -> None:
        """The executing thread stops: the worker takes over what is queued behind."""
        self.running = False
        if self.pending and self.state == QpState.RTS:
            self.work_cv.notify()

    def complete_locked(self, span: Span, k: int) -> None:
        """The ``k`` requests from ``span.pos`` on succeeded (``span`` is the head)."""
        if k <= 0:
            return
        a = span.pos
        b = a + k
        span.pos = b
        if b == len(span.batch):
            self.pending.popleft()
        self.succeeded_locked(span.batch, a, b)

    def quiesce_locked(self) -> None:
        self.work_cv.notify_all()
        # The worker may be moving bytes of the head chunk right now: no flush is reported
        # before that copy ended (one window: about a millisecond, never a wait on the peer).
        with self.copy_lock:
            pass
