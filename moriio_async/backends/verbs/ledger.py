"""One queue pair's send-queue ledger: what was posted, what is covered, what must be made up.

The verbs backend cannot take everything from the hardware. A completion for
an RDMA WRITE or a flushed request does not say its opcode or length (verbs
leaves ``opcode`` and ``byte_len`` undefined on error completions), an
unsignaled success has no completion at all, and a queue pair on a dead
device may never produce the flushes the contract promises. So the backend
keeps, per queue pair and on the event-loop thread only, the ordered record
of requests it gave the hardware, and:

* a hardware completion covers its own request and every earlier one still
  listed (RC completes in order, so an unsignaled request before a completed
  one is done); the covered ones give back their send-queue slots;
* requests the hardware never got (posted after the pair was declared dead, or
  refused by the post) complete "synthetically", from this ledger; synthetic
  completions wait until every earlier hardware request is covered, so a
  pair's completions stay in posting order;
* ``kill`` (a fatal device event, or a destroyed pair) turns every request still
  listed into a synthetic completion and from then on ignores the hardware's
  completions for this pair, which would only repeat them.

Requests are recorded as spans over the posted ``WorkBatch`` (its wr_ids are
consecutive), never as an object per request: posting a chunk appends one span
(the single read or write, posted as integers, is a span of one with no batch),
a completion trims or drops spans, and the batch's arrays are read only for the
one request a completion names. Made-up completions are spans too, expanded one
completion per request only when polled (a failed request always completes).
"""

from __future__ import annotations

from collections import deque
from typing import ClassVar

from ...status import Opcode, WcStatus
from ...work import WorkBatch, WorkCompletion

__all__ = ["FENCE_WR_ID", "SendLedger"]

FENCE_WR_ID = (1 << 64) - 1
"""The wr_id of the backend's own fence request (never delivered): see ``SendLedger.fence``."""

_OPCODES = {int(op): op for op in Opcode}


class _Span:
    """wr_ids ``pos..end-1``, given to the hardware or refused. A made-up span also carries the
    status of its first request (the rest are flushes) and that request's vendor error."""

    __slots__ = ("end", "pos", "status", "vendor_err")
    fence: ClassVar[bool] = False

    def __init__(self, pos: int, end: int) -> None:
        self.pos = pos
        self.end = end
        self.status = WcStatus.SUCCESS
        self.vendor_err = 0

    def opcode(self, wr_id: int) -> Opcode:
        raise NotImplementedError

    def length(self, wr_id: int) -> int:
        raise NotImplementedError


class _Batch(_Span):
    """Requests of a posted ``WorkBatch`` (request ``i`` of it is wr_id ``batch.wr_id + i``)."""

    __slots__ = ("batch",)

    def __init__(self, batch: WorkBatch, pos: int, end: int) -> None:
        super().__init__(pos, end)
        self.batch = batch

    def opcode(self, wr_id: int) -> Opcode:
        return _OPCODES[int(self.batch.opcode[wr_id - self.batch.wr_id])]

    def length(self, wr_id: int) -> int:
        return int(self.batch.length[wr_id - self.batch.wr_id])


class _One(_Span):
    """The single read or write posted as plain integers (``VerbsQueuePair.post_one``): no batch."""

    __slots__ = ("nbytes", "op")

    def __init__(self, wr_id: int, op: Opcode, nbytes: int) -> None:
        super().__init__(wr_id, wr_id + 1)
        self.op = op
        self.nbytes = nbytes

    def opcode(self, wr_id: int) -> Opcode:
        return self.op

    def length(self, wr_id: int) -> int:
        return self.nbytes


class _Fence(_Span):
    """The backend's own fence (``SendLedger.fence``): covers, never delivered."""

    __slots__ = ()
    fence = True

    def opcode(self, wr_id: int) -> Opcode:
        return Opcode.RDMA_WRITE

    def length(self, wr_id: int) -> int:
        return 0


class SendLedger:
    """Slot accounting and synthetic completions for one queue pair (event-loop thread only)."""

    __slots__ = ("_fences", "_hw", "_n_hw", "_n_synth", "_synth", "closed", "dead", "depth", "errored", "qp_num")

    def __init__(self, qp_num: int, depth: int) -> None:
        self.qp_num = qp_num
        self.depth = depth
        self._hw: deque[_Span] = deque()
        self._synth: deque[_Span] = deque()
        self._n_hw = 0
        """Requests in ``_hw`` (fences excluded)."""
        self._n_synth = 0
        self._fences = 0
        self.dead = False
        """The hardware's completions for this pair are ignored; every post is synthetic."""
        self.errored = False
        """An error completion was already reported: later ones are flushes."""
        self.closed = False
        """The pair is destroyed: the ledger goes once its last completion is polled."""

    @property
    def outstanding(self) -> int:
        """Requests given to the hardware and not yet covered (fences excluded)."""
        return self._n_hw

    @property
    def held(self) -> int:
        """Slots held: outstanding hardware requests plus synthetic completions not yet polled."""
        return self._n_hw + self._n_synth

    @property
    def free(self) -> int:
        return self.depth - self.held

    @property
    def must_synthesize(self) -> bool:
        """New posts must not reach the hardware (order would break, or the pair is dead)."""
        return self.dead or bool(self._synth)

    @property
    def synth_ready(self) -> bool:
        return bool(self._synth) and not self._hw

    def posted(self, batch: WorkBatch, stop: int | None = None) -> None:
        """Record that the hardware accepted requests ``0:stop`` of ``batch`` (all when None)."""
        n = len(batch) if stop is None else stop
        if n > 0:
            self._hw.append(_Batch(batch, batch.wr_id, batch.wr_id + n))
            self._n_hw += n

    def posted_one(self, wr_id: int, opcode: Opcode, length: int) -> None:
        """Record that the hardware accepted the single request ``wr_id`` (``posted`` without a batch)."""
        self._hw.append(_One(wr_id, opcode, length))
        self._n_hw += 1

    def describe(self) -> str:
        """For error messages: what holds the slots."""
        spans = ["fence" if s.fence else f"{s.pos}..{s.end - 1}" for s in self._hw]
        shown = spans if len(spans) <= 6 else [*spans[:3], "...", *spans[-2:]]
        return f"hardware {shown} ({self._fences} fences), {self._n_synth} made-up, dead={self.dead}"

    def fence(self) -> None:
        """Record the backend's signaled fence, posted on a pair already in ERR.

        Synthetic completions wait for every earlier hardware request; but an
        unsignaled request that succeeded before the error never completes on
        its own. The fence's flush completion covers it, so the wait ends.
        """
        self._hw.append(_Fence(FENCE_WR_ID, FENCE_WR_ID + 1))
        self._fences += 1

    def refused(self, batch: WorkBatch, status: WcStatus, start: int = 0, vendor_err: int = 0) -> None:
        """Record that requests ``start:`` of ``batch`` never reached the hardware: the first
        completes with ``status``, the rest flush."""
        if start < len(batch):
            self._add_synth(_Batch(batch, batch.wr_id + start, batch.wr_id + len(batch)), status, vendor_err)

    def complete(self, wr_id: int, status: WcStatus, vendor_err: int, byte_len: int) -> WorkCompletion | None:
        """A hardware completion: the translated one, or None when it must be dropped."""
        if self.dead:
            return None
        hw = self._hw
        index = 0
        for span in hw:  # almost always the first: RC completes in posting order
            if span.pos <= wr_id < span.end:
                break
            index += 1
        else:
            return None  # not ours (already synthesized): drop
        for _ in range(index):  # earlier spans were unsignaled and are done: RC completes in order
            self._drop(hw.popleft())
        if span.fence:
            hw.popleft()
            self._fences -= 1
            return None
        self._n_hw -= wr_id + 1 - span.pos
        if wr_id + 1 == span.end:
            hw.popleft()
        else:
            span.pos = wr_id + 1
        opcode = span.opcode(wr_id)
        if status is not WcStatus.SUCCESS:
            self.errored = True
            byte_len = 0
        elif opcode is Opcode.RDMA_WRITE or byte_len == 0:
            byte_len = span.length(wr_id)  # verbs leaves byte_len undefined for a WRITE's completion
        return WorkCompletion(wr_id, status, opcode, byte_len, self.qp_num, vendor_err)

    def kill(self, status: WcStatus = WcStatus.FATAL_ERR) -> None:
        """Give up on the hardware: everything listed completes synthetically, before later posts."""
        if self.dead:
            return
        self.dead = True
        made_up = [span for span in self._hw if not span.fence]
        self._hw.clear()
        self._n_hw = 0
        self._fences = 0
        earlier, self._synth, self._n_synth = self._synth, deque(), 0
        for span in made_up:
            self._add_synth(span, status, 0)
            status = WcStatus.WR_FLUSH_ERR
        self._synth.extend(earlier)
        self._n_synth += sum(s.end - s.pos for s in earlier)

    def take_synth(self, max_entries: int) -> list[WorkCompletion]:
        """Synthetic completions that may be delivered now (none while hardware ones are due)."""
        out: list[WorkCompletion] = []
        synth = self._synth
        while synth and not self._hw and len(out) < max_entries:
            span = synth[0]
            stop = min(span.end, span.pos + max_entries - len(out))
            for wr_id in range(span.pos, stop):
                out.append(WorkCompletion(wr_id, span.status, span.opcode(wr_id), 0, self.qp_num, span.vendor_err))
                span.status, span.vendor_err = WcStatus.WR_FLUSH_ERR, 0
            self._n_synth -= stop - span.pos
            span.pos = stop
            if stop == span.end:
                synth.popleft()
        return out

    def _add_synth(self, span: _Span, status: WcStatus, vendor_err: int) -> None:
        if self.errored and status is not WcStatus.WR_FLUSH_ERR:
            status = WcStatus.WR_FLUSH_ERR
        if status is not WcStatus.SUCCESS:
            self.errored = True
        span.status, span.vendor_err = status, vendor_err
        self._synth.append(span)
        self._n_synth += span.end - span.pos

    def _drop(self, span: _Span) -> None:
        if span.fence:
            self._fences -= 1
        else:
            self._n_hw -= span.end - span.pos
