"""An initiator queue pair's locked state: posted spans, in-order completion, and the move to ERR.

One worker thread executes the posted requests oldest first, a chunk at a
time; completions are pushed in posting order because only that thread
completes successes, always for the head span, and a failure flushes from
the head on.

The lock rules, in one place:

* ``lock`` guards every field. The poster (``admit_locked``), the worker
  (``complete_locked``), the reader (``fail``), ``to_error`` and ``close``
  take it; nothing blocks while holding it, except that entering ERR waits
  for ``copy_lock`` (below). Completions are pushed under it (the CQ's lock
  nests inside).
* ``copy_lock`` is held while bytes move (a window of a chunk) and while
  the reader applies a revocation. Entering ERR waits for it, so no byte
  lands after a flush is visible; a revocation is acknowledged only after
  the copy in progress ended. Nothing takes ``lock`` while holding it.
* Slots: ``posted`` is written under ``lock``; ``released`` by the CQ's
  poller, under the CQ's lock (``release_slots``).
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

from ...status import Opcode, WcStatus
from ...work import WorkBatch, WorkCompletion
from ..base import QpState
from ..softcq import SoftCompletionQueue
from ..softpair import Completions, fold_successes
from .kernel import IOV_MAX

__all__ = ["PairState", "Span"]

_OPCODES = {int(o): o for o in Opcode}
_RTS, _ERR = QpState.RTS, QpState.ERR
_FLUSH = WcStatus.WR_FLUSH_ERR


class Span:
    """Posted requests ``pos:`` of ``batch`` not yet completed (only the worker moves ``pos``)."""

    __slots__ = ("batch", "cuts", "ends", "pos")

    def __init__(self, batch: WorkBatch) -> None:
        self.batch = batch
        self.pos = 0
        self.cuts: list[int] | None = None  # where the opcode changes, then len(batch)
        self.ends: np.ndarray | None = None  # cumulative request lengths

    def next_chunk(self, max_bytes: int) -> int:
        """Where the chunk from ``pos`` ends: one opcode, at most ``max_bytes`` (at least one request),
        at most IOV_MAX requests and IOV_MAX local SGEs."""
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
        starts = batch.sge_start
        by_sges = int(np.searchsorted(starts, int(starts[pos]) + IOV_MAX, side="right")) - 1
        return max(pos + 1, min(run_end, pos + IOV_MAX, by_bytes, by_sges))


class PairState:
    """One active queue pair's posted and outstanding requests, its counters and its state."""

    def __init__(self, qp_num: int, cq: SoftCompletionQueue) -> None:
        self.qp_num = qp_num
        self.cq = cq
        self.lock = threading.Lock()
        self.work_cv = threading.Condition(self.lock)
        self.copy_lock = threading.Lock()
        self.state = QpState.INIT
        self.pending: deque[Span] = deque()
        self.posted = 0
        self.released = 0
        self.uncovered = 0  # successful unsignaled requests the next completion covers
        self.closed = False

    def admit_locked(self, batch: WorkBatch) -> None:
        """Accept a checked batch that fits the send queue (in ERR: flush it at once, as verbs does)."""
        self.posted += len(batch)
        if self.state == _ERR:
            self._push(self._flushes(batch, 0, _FLUSH, 0))
            return
        self.pending.append(Span(batch))
        self.work_cv.notify()

    def release_slots(self, n: int) -> None:
        self.released += n

    def complete_locked(self, span: Span, k: int) -> None:
        """The ``k`` requests from ``span.pos`` on succeeded (``span`` is the head)."""
        if k <= 0:
            return
        batch = span.batch
        a = span.pos
        b = a + k
        span.pos = b
        if b == len(batch):
            self.pending.popleft()
        out, self.uncovered = fold_successes(batch, a, b, self.uncovered, self.qp_num)
        if out:
            self.cq.push_many(out, self)

    def fail(self, status: WcStatus, vendor: int) -> None:
        with self.lock:
            self.fail_locked(status, vendor)

    def fail_locked(self, status: WcStatus, vendor: int) -> None:
        """Enter ERR: the oldest outstanding request gets ``status``, every later one WR_FLUSH_ERR."""
        if self.state == _ERR:
            return
        self.state = _ERR
        self.work_cv.notify_all()
        # The worker may be moving bytes of the head chunk right now: no flush is reported
        # before that copy ended (one window: about a millisecond, never a wait on the peer).
        with self.copy_lock:
            pass
        out: Completions = []
        for span in self.pending:
            out += self._flushes(span.batch, span.pos, status, vendor)
            if out:
                status, vendor = _FLUSH, 0
        self.pending.clear()
        self._push(out)

    def _flushes(self, batch: WorkBatch, start: int, status: WcStatus, vendor: int) -> Completions:
        """Completions for requests ``start:``: the first with ``status``, the rest flushed."""
        out: Completions = []
        first, qp_num = batch.wr_id, self.qp_num
        for i, op in enumerate(batch.opcode[start:].tolist(), start):
            out.append((WorkCompletion(first + i, status, _OPCODES[op], 0, qp_num, vendor), self.uncovered + 1))
            self.uncovered = 0
            status, vendor = _FLUSH, 0
        return out

    def _push(self, out: Completions) -> None:
        if out:
            self.cq.push_many(out, self)
