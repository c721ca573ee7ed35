"""One queue pair's send-queue ledger: what was posted, what is covered, what must be made up.

The verbs backend cannot take everything from the hardware. A completion for
an RDMA WRITE or a flushed request does not say its opcode or length (verbs
leaves ``opcode`` and ``byte_len`` undefined on error completions), an
unsignaled success has no completion at all, and a queue pair on a dead
device may never produce the flushes the contract promises. So the backend
keeps, per queue pair and on the event-loop thread only, the ordered list of
requests it gave the hardware, and:

* a hardware completion covers its own request and every earlier one still
  listed (RC completes in order, so an unsignaled request before a completed
  one is done); the covered ones give back their send-queue slots;
* requests the hardware never got (posted after the pair was declared dead, or
  refused by ``ibv_post_send``) complete "synthetically", from this ledger;
  synthetic completions wait until every earlier hardware request is covered,
  so a pair's completions stay in posting order;
* ``kill`` (a fatal device event, or a destroyed pair) turns every request still
  listed into a synthetic completion and from then on ignores the hardware's
  completions for this pair, which would only repeat them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from ...status import Opcode, WcStatus
from ...work import WorkCompletion, WorkRequest

__all__ = ["FENCE_WR_ID", "SendLedger"]

FENCE_WR_ID = (1 << 64) - 1
"""The wr_id of the backend's own fence request (never delivered): see ``SendLedger.fence``."""


@dataclass(frozen=True, slots=True)
class _Posted:
    wr_id: int
    opcode: Opcode
    length: int


class SendLedger:
    """Slot accounting and synthetic completions for one queue pair (event-loop thread only)."""

    __slots__ = ("_fences", "_hw", "_synth", "closed", "dead", "depth", "errored", "qp_num")

    def __init__(self, qp_num: int, depth: int) -> None:
        self.qp_num = qp_num
        self.depth = depth
        self._hw: deque[_Posted] = deque()
        self._synth: deque[WorkCompletion] = deque()
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
        return len(self._hw) - self._fences

    @property
    def held(self) -> int:
        """Slots held: outstanding hardware requests plus synthetic completions not yet polled."""
        return self.outstanding + len(self._synth)

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

    def posted(self, wrs: Iterable[WorkRequest]) -> None:
        """Record requests the hardware accepted."""
        self._hw.extend(_Posted(wr.wr_id, wr.opcode, wr.length) for wr in wrs)

    def describe(self) -> str:
        """For error messages: what holds the slots."""
        ids = [p.wr_id for p in self._hw]
        shown = ids if len(ids) <= 8 else [*ids[:4], "...", *ids[-2:]]
        return f"hardware {shown} ({self._fences} fences), {len(self._synth)} made-up, dead={self.dead}"

    def fence(self) -> None:
        """Record the backend's signaled fence, posted on a pair already in ERR.

        Synthetic completions wait for every earlier hardware request; but an
        unsignaled request that succeeded before the error never completes on
        its own. The fence's flush completion covers it, so the wait ends.
        """
        self._hw.append(_Posted(FENCE_WR_ID, Opcode.RDMA_WRITE, 0))
        self._fences += 1

    def refused(self, wrs: Iterable[WorkRequest], status: WcStatus, vendor_err: int = 0) -> None:
        """Record requests the hardware never got: each completes with ``status``, then flushes."""
        for wr in wrs:
            self._synth.append(self._made_up(wr.wr_id, wr.opcode, status, vendor_err))
            status = WcStatus.WR_FLUSH_ERR

    def complete(self, wr_id: int, status: WcStatus, vendor_err: int, byte_len: int) -> WorkCompletion | None:
        """A hardware completion: the translated one, or None when it must be dropped."""
        if self.dead:
            return None
        for posted in self._hw:
            if posted.wr_id == wr_id:
                break
        else:
            return None  # not ours (already synthesized): drop
        while True:
            head = self._hw.popleft()
            if head.wr_id == FENCE_WR_ID:
                self._fences -= 1
            if head is posted:
                break  # earlier ones were unsignaled and are done: RC completes in order
        if wr_id == FENCE_WR_ID:
            return None
        if status is not WcStatus.SUCCESS:
            self.errored = True
            byte_len = 0
        elif posted.opcode is Opcode.RDMA_WRITE or byte_len == 0:
            byte_len = posted.length  # verbs leaves byte_len undefined for a WRITE's completion
        return WorkCompletion(posted.wr_id, status, posted.opcode, byte_len, self.qp_num, vendor_err)

    def kill(self, status: WcStatus = WcStatus.FATAL_ERR) -> None:
        """Give up on the hardware: everything listed completes synthetically, before later posts."""
        if self.dead:
            return
        self.dead = True
        made_up = []
        for posted in self._hw:
            if posted.wr_id == FENCE_WR_ID:
                continue
            made_up.append(self._made_up(posted.wr_id, posted.opcode, status, 0))
            status = WcStatus.WR_FLUSH_ERR
        self._hw.clear()
        self._fences = 0
        self._synth.extendleft(reversed(made_up))

    def take_synth(self, max_entries: int) -> list[WorkCompletion]:
        """Synthetic completions that may be delivered now (none while hardware ones are due)."""
        out: list[WorkCompletion] = []
        while self._synth and not self._hw and len(out) < max_entries:
            out.append(self._synth.popleft())
        return out

    def _made_up(self, wr_id: int, opcode: Opcode, status: WcStatus, vendor_err: int) -> WorkCompletion:
        if self.errored and status is not WcStatus.WR_FLUSH_ERR:
            status = WcStatus.WR_FLUSH_ERR
        if status is not WcStatus.SUCCESS:
            self.errored = True
        return WorkCompletion(wr_id, status, opcode, 0, self.qp_num, vendor_err)
