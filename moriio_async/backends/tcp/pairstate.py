"""The TCP queue pair's locked state: what is posted, on the wire and outstanding, in order; the move to ERR.

Requests are never objects here. ``pending`` holds spans of posted batches
that no sender has taken yet; ``wire`` holds chunks (consecutive requests of
one batch with one opcode, the unit framed on the wire) that are being
built, sent, or *preset* (given their outcome without the wire: a local
protection error, or a status chosen by a fault hook), oldest first.
Completions come off the head of ``wire`` only, so they are in posting
order whichever thread makes them; a response completes a range of requests
at once, pushing a completion for each signaled one (O(signaled), not
O(requests)) and counting the rest as covered by the next.

The lock rules, in one place:

* ``lock`` guards every field of this object. The poster (``admit``), the
  sender (``take``, ``settle``), the receiver (``complete``, ``fail``),
  ``to_error`` and ``close`` take it; nothing blocks while holding it,
  except that entering ERR waits for ``rx_lock`` (below), and every
  completion is pushed to the CQ under it (the CQ's lock nests inside).
* ``send_cv`` and ``recv_cv`` (conditions on ``lock``) wake the sender and
  the receiver.
* ``tx_lock`` is held by whoever writes chunks to the socket: the sender
  thread, or a post ringing the doorbell (which only ever tries it). Chunks
  are taken from ``pending`` while holding it, so the socket sees them in
  posting order. It owns ``tx_pending`` (a doorbell's partly sent write,
  pinning the initiator's buffer): parked only in RTS (``park``), taken or
  released under it. When the pair enters ERR its holder releases what is
  parked: the sender on its way out, a doorbell by not parking, else
  ``fail_locked``, which only tries it. (A write parked after the sender
  left used to keep its pins for ever, and deregistration waited on them.)
* ``tx_io`` is held by the sender while its socket call moves local bytes,
  until it unpinned them; entering ERR waits for it after the shutdown, as
  for ``rx_lock``: no flush is visible while a flushed request's pin is held.
* ``aborted`` is set once, by ``abort`` (under a region's lock, without
  ``lock``); a stale read only changes the status reported.
* ``rx_lock`` is held by the receiver while a READ response lands in local
  memory; entering ERR shuts the socket down (which ends that call) and
  then waits for it, so no byte lands after a flush is visible.
* Slots: ``posted`` is written under ``lock``; ``released`` by the CQ's
  poller, under the CQ's lock (``release_slots``); the poster reads their
  difference. Each has one writer.
* A call that keeps the GIL (``HeldIo``) may sleep for the socket's own lock
  (the kernel's, serialising calls on one TCP socket), with every Python
  thread of the process stopped meanwhile. A blocking ``sendmsg`` holds that
  lock while it copies a whole round (4 MiB: about a millisecond), so the
  receiver keeps the GIL for a receive only while ``writing()`` says no write
  is under way; otherwise the event loop stalled for the round and the sender
  then waited for the GIL when its call ended (20% of a 1 MiB WRITE stream's
  throughput here). The other way round needs nothing: a receive holds the
  lock only while it copies what has already arrived (keeping the doorbell's
  sends off a large READ response's receive measured no gain).
* Order: ``lock`` before the CQ's lock and before a region's pin lock;
  ``tx_lock`` before ``lock`` (the sender), while ``lock`` before ``tx_lock``
  happens only as a non-blocking try (the doorbell, and ``fail_locked``);
  nothing takes ``lock`` while holding ``rx_lock`` or ``tx_io`` (entering ERR
  holds ``lock`` and waits for them).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ...status import Opcode, WcStatus
from ...work import WorkBatch, WorkCompletion
from ..base import QpState
from ..softcq import SoftCompletionQueue
from ..softpair import Completions, fold_successes
from .hooks import Hooks
from .iov import HeldIo, Iov
from .regions import Checked, RegionTable
from .wire import MAX_CHUNK, SEQ_MASK, VendorErr

__all__ = ["CHUNK_BYTES", "Chunk", "PairState", "PendingWrite", "Span", "Stoppable"]

CHUNK_BYTES = 1 << 20
"""Payload bytes per chunk (at least one request): a response completes about this much at once."""

_OPCODES = {int(o): o for o in Opcode}
_READ = int(Opcode.RDMA_READ)
_RTS, _ERR = QpState.RTS, QpState.ERR
_SUCCESS, _FLUSH = WcStatus.SUCCESS, WcStatus.WR_FLUSH_ERR


class Stoppable(Protocol):
    def stop(self) -> None:
        """Stop serving (from any thread)."""

    def join(self) -> None:
        """Wait until it stopped (unless called from its own thread)."""


@dataclass(eq=False, slots=True)
class PendingWrite:
    """A doorbell write the socket took only part of; the sender thread finishes it first."""

    iov: Iov | None
    buffers: list[bytes | memoryview] | None
    """The rest as socket-module buffers instead (a one-request round)."""
    start: int
    left: int
    release: Callable[[], None]
    """Unpins the regions the iovecs point into (call once the bytes are out)."""
    keep: object
    """What else the iovecs point into (the chunk headers), kept alive until then."""


class Span:
    """Posted requests ``pos:`` of ``batch`` that no sender has taken; request ``i`` is posting number ``seq + i``."""

    __slots__ = ("batch", "cuts", "ends", "pos", "seq")

    def __init__(self, batch: WorkBatch, seq: int) -> None:
        self.batch = batch
        self.seq = seq
        self.pos = 0
        self.cuts: list[int] | None = None  # where the opcode changes, then len(batch)
        self.ends: np.ndarray | None = None  # cumulative request lengths

    def next_chunk(self, single: bool) -> int:
        """Where the chunk starting at ``pos`` ends: one opcode, at most MAX_CHUNK requests and
        about CHUNK_BYTES of payload (at least one request)."""
        batch, pos = self.batch, self.pos
        n = len(batch)
        if single or n - pos == 1:
            return pos + 1
        if self.cuts is None:
            self.cuts = [*(np.flatnonzero(np.diff(batch.opcode)) + 1).tolist(), n]
            self.ends = np.cumsum(batch.length)
        assert self.ends is not None
        run_end = next(c for c in self.cuts if c > pos)
        before = int(self.ends[pos - 1]) if pos else 0
        by_bytes = int(np.searchsorted(self.ends, before + CHUNK_BYTES, side="right"))
        return max(pos + 1, min(run_end, pos + MAX_CHUNK, by_bytes))


class Chunk:
    """Requests ``lo:hi`` of ``batch`` (one opcode); ``next`` is the first not yet completed."""

    __slots__ = ("batch", "blocks", "hi", "iov", "lo", "local", "next", "opcode", "preset", "sent", "seq", "views")

    def __init__(self, batch: WorkBatch, lo: int, hi: int, seq: int) -> None:
        self.batch = batch
        self.lo = lo
        self.hi = hi
        self.next = lo
        self.seq = seq  # posting number of request lo
        self.opcode = batch.opcode.item(lo)
        self.sent = False  # on the wire: its response will come
        self.preset: tuple[WcStatus, int] | None = None
        self.local: Checked | None = None  # a READ's local SGEs, checked (the receiver pins them)
        self.iov: Iov | None = None  # a READ's scatter list: one row per local SGE of lo:hi
        self.views: list[memoryview] | None = None  # or, for a one-request READ, its SGEs as views
        self.blocks: list[tuple[int, int]] | None = None  # and as (address, length) pairs

    @property
    def is_read(self) -> bool:
        return self.opcode == _READ

    def wire_seq(self, i: int) -> int:
        return (self.seq + i - self.lo) & SEQ_MASK


class PairState:
    """One queue pair's posted, sent and outstanding requests, its counters and its state."""

    def __init__(self, qp_num: int, cq: SoftCompletionQueue, regions: RegionTable, hooks: Hooks | None) -> None:
        self.qp_num = qp_num
        self.cq = cq
        self.regions = regions
        self.hooks = hooks
        """Fault-injection seams (``hooks.py``); read by the NIC threads at each request."""
        self.lock = threading.Lock()
        self.send_cv = threading.Condition(self.lock)
        self.recv_cv = threading.Condition(self.lock)
        self.tx_lock = threading.Lock()
        self.rx_lock = threading.Lock()
        self.tx_io = threading.Lock()
        self.state = QpState.INIT
        self.pending: deque[Span] = deque()
        self.wire: deque[Chunk] = deque()
        self.posted = 0
        self.released = 0
        self.uncovered = 0  # successful unsignaled requests the next completion covers
        self.send_stopped = False  # a request failed locally: nothing after it is sent
        self.tx_pending: PendingWrite | None = None  # written under tx_lock
        self.held = HeldIo()
        """The doorbell's non-blocking writes that keep the GIL (used under tx_lock)."""
        self.sock: socket.socket | None = None  # the active side's connection
        self.responder: Stoppable | None = None  # the passive side's
        self.retry_timeout = 5.0
        """The silence timeout (set by the pair): also the base of a response's deadline once it came short."""
        self.closed = False
        self.aborted = False  # a local region one of its socket calls held was deregistered

    def writing(self) -> bool:
        """A round or a doorbell may be in a socket call that holds the socket's lock: no receive
        that keeps the GIL now. (One that starts right after this answered False can still make a
        receive wait once, for one call: rare, and no worse than without the check.)"""
        return self.tx_lock.locked()

    # -- the passive side ---------------------------------------------------------------

    def attach(self, responder: Stoppable) -> bool:
        """The dial carrying our token arrived; False if this pair is gone or taken meanwhile."""
        with self.lock:
            if self.closed or self.state != _RTS or self.responder is not None:
                return False
            self.responder = responder
            return True

    def responder_done(self) -> None:
        """The passive pair's connection ended: the pair is unusable from now on."""
        with self.lock:
            self.state = _ERR

    # -- posting and sending ----------------------------------------------------------

    def admit_locked(self, batch: WorkBatch) -> None:
        """Accept a checked batch that fits the send queue (in ERR: flush it at once, as verbs does)."""
        seq = self.posted
        self.posted += len(batch)
        if self.state == _ERR:
            self._push(self._flushes(batch, 0, _FLUSH, 0))
            return
        self.pending.append(Span(batch, seq))

    def take_locked(self, max_bytes: int) -> list[Chunk]:
        """Move the next chunks from ``pending`` to ``wire`` (unsent) for one write of at most about
        ``max_bytes`` of payload. The caller holds ``tx_lock``."""
        chunks: list[Chunk] = []
        if self.state != _RTS or self.send_stopped:
            return chunks
        single = self.hooks is not None  # a hooked pair sends (and so answers) one request at a time
        total = 0
        while self.pending and total < max_bytes:
            span = self.pending[0]
            end = span.next_chunk(single)
            chunk = Chunk(span.batch, span.pos, end, span.seq + span.pos)
            chunks.append(chunk)
            if not chunk.is_read:
                total += span.batch.length.item(span.pos) if end == span.pos + 1 else _bytes(span, end)
            span.pos = end
            if end == len(span.batch):
                self.pending.popleft()
        self.wire.extend(chunks)
        return chunks

    def settle_locked(self, chunks: list[Chunk], presets: dict[int, tuple[int, WcStatus, int]]) -> bool:
        """The sender built ``chunks``: mark them sent, except where ``presets`` (chunk index ->
        request, status, vendor) gives requests their outcome without the wire. After a preset
        failure nothing more is sent (what follows stays unsent, to be flushed). False when the
        pair left RTS meanwhile: send nothing."""
        if self.state != _RTS:
            return False
        for k, chunk in enumerate(chunks):
            preset = presets.get(k)
            if preset is None:
                chunk.sent = True
                continue
            i, status, vendor = preset
            target = chunk
            if i > chunk.lo:  # the requests before it still go out
                target = Chunk(chunk.batch, i, chunk.hi, chunk.seq + i - chunk.lo)
                chunk.hi = i
                chunk.sent = True
                self.wire.insert(self.wire.index(chunk) + 1, target)
            target.preset = (status, vendor)
            if status is not _SUCCESS:
                self.send_stopped = True
                break
        if self.wire and self.wire[0] is chunks[0]:
            self.recv_cv.notify()  # the receiver waits only while the head is unsent
        self.complete_presets_locked()
        return True

    # -- the doorbell's leftover (owned by tx_lock) -------------------------------------

    def park(self, pending: PendingWrite) -> bool:
        """Leave a doorbell's partly sent write to the sender thread (the caller holds ``tx_lock``).
        False, parking nothing, once the pair left RTS: the caller then releases it, since the
        sender may be gone already."""
        with self.lock:
            if self.state != _RTS:
                return False
            self.tx_pending = pending
            self.send_cv.notify()
            return True

    def take_parked(self) -> PendingWrite | None:
        """What a doorbell parked, now the caller's to send and release (it holds ``tx_lock``)."""
        left, self.tx_pending = self.tx_pending, None
        return left

    def drop_parked(self) -> None:
        """Release what is parked without sending it (the caller holds ``tx_lock``; the pair is
        leaving RTS, so its requests are flushed)."""
        left, self.tx_pending = self.tx_pending, None
        if left is not None:
            left.release()

    # -- completing -------------------------------------------------------------------

    def release_slots(self, n: int) -> None:
        self.released += n

    def complete_locked(self, chunk: Chunk, k: int) -> None:
        """Requests ``chunk.next`` to ``chunk.next + k`` succeeded (``chunk`` is the head)."""
        a = chunk.next
        b = a + k
        chunk.next = b
        if b == chunk.hi:
            self.wire.popleft()
        out, self.uncovered = fold_successes(chunk.batch, a, b, self.uncovered, self.qp_num)
        if out:
            self.cq.push_many(out, self)

    def complete_presets_locked(self) -> None:
        """Complete (or fail at) preset chunks that reached the head."""
        wire = self.wire
        while wire and wire[0].preset is not None and self.state == _RTS:
            chunk = wire[0]
            status, vendor = chunk.preset  # type: ignore[misc]
            if status is not _SUCCESS:
                self.fail_locked(status, vendor)
                return
            self.complete_locked(chunk, chunk.hi - chunk.next)

    # -- the error state ----------------------------------------------------------------

    def abort(self) -> None:
        """A local region this pair's socket call holds is being deregistered (``regions.Abortable``):
        end the call now (the pair fails LOC_PROT_ERR), rather than have deregistration wait for a
        peer reading slowly. Called under the region's lock, so no pair lock: a flag, a shutdown."""
        self.aborted = True
        sock = self.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def peer_lost(self, vendor: VendorErr) -> None:
        with self.lock:
            if self.state == _RTS:
                if self.aborted:  # our own shutdown (``abort``), not the peer's doing
                    self.fail_locked(WcStatus.LOC_PROT_ERR, VendorErr.LOCAL_DEREGISTERED)
                else:
                    self.fail_locked(WcStatus.RETRY_EXC_ERR, vendor)

    def fail(self, status: WcStatus, vendor: int) -> None:
        with self.lock:
            self.fail_locked(status, vendor)

    def fail_locked(self, status: WcStatus, vendor: int) -> None:
        """Enter ERR: the oldest outstanding request gets ``status``, every later one WR_FLUSH_ERR."""
        if self.state == _ERR:
            return
        self.state = _ERR
        self.send_cv.notify_all()
        self.recv_cv.notify_all()
        if self.responder is not None:
            self.responder.stop()
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)  # wakes both threads; the peer sees the end
            # The receiver may be scattering a READ response into local memory right now;
            # the shutdown makes that call return, and no flush is reported before it has.
            with self.rx_lock:
                pass
            # Likewise the sender may be writing a round from local memory: its pins drop before
            # any flush is visible. (The call ended with the shutdown; this is microseconds.)
            with self.tx_io:
                pass
        if self.tx_lock.acquire(blocking=False):  # nobody to release it otherwise (see the rules)
            try:
                self.drop_parked()
            finally:
                self.tx_lock.release()
        out: Completions = []
        for chunk in self.wire:
            out += self._flushes(chunk.batch, chunk.next, status, vendor, chunk.hi)
            if out:
                status, vendor = _FLUSH, 0
        for span in self.pending:
            out += self._flushes(span.batch, span.pos, status, vendor)
            if out:
                status, vendor = _FLUSH, 0
        self.wire.clear()
        self.pending.clear()
        self._push(out)

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


def _bytes(span: Span, end: int) -> int:
    assert span.ends is not None
    return int(span.ends[end - 1]) - (int(span.ends[span.pos - 1]) if span.pos else 0)
