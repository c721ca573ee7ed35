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

The lock rules, in one place (with the ones every software pair follows,
``soft/state.py``: ``lock`` guards every field, completions are pushed under
it, ``posted``/``released`` have one writer each):

* The poster (``admit``, ``take_one_locked``), the sender (``take``,
  ``settle``), the receiver (``complete``, ``fail``), ``to_error`` and
  ``close`` take ``lock``. Entering ERR (``quiesce_locked``) waits for
  ``rx_lock`` and ``tx_io`` (below).
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from ...status import Opcode, WcStatus
from ...work import WorkBatch
from ..base import QpState
from ..soft.cq import SoftCompletionQueue
from ..soft.state import SoftPairState
from ..soft.state import Span as SoftSpan
from .hooks import Hooks
from .iov import HeldIo, Iov
from .regions import Checked, RegionTable
from .wire import MAX_CHUNK, SEQ_MASK, VendorErr

__all__ = ["CHUNK_BYTES", "Chunk", "PairState", "PendingWrite", "Span", "Stoppable"]

CHUNK_BYTES = 1 << 20
"""Payload bytes per chunk (at least one request): a response completes about this much at once."""

_READ = int(Opcode.RDMA_READ)
_RTS, _ERR = QpState.RTS, QpState.ERR
_SUCCESS = WcStatus.SUCCESS


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


class Span(SoftSpan):
    """Posted requests ``pos:`` of ``batch`` that no sender has taken; request ``i`` is posting number ``seq + i``."""

    __slots__ = ()

    def next_chunk(self, single: bool) -> int:
        """Where the chunk starting at ``pos`` ends: one opcode, at most MAX_CHUNK requests and
        about CHUNK_BYTES of payload (at least one request); one request for a hooked pair."""
        return self.pos + 1 if single else self.cut(CHUNK_BYTES, MAX_CHUNK)


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


class PairState(SoftPairState[Span]):
    """One queue pair's posted, sent and outstanding requests, its counters and its state."""

    def __init__(
        self,
        qp_num: int,
        cq: SoftCompletionQueue,
        regions: RegionTable,
        hooks: Hooks | None,
        retry_timeout: float = 5.0,
    ) -> None:
        super().__init__(qp_num, cq, Span)
        self.regions = regions
        self.hooks = hooks
        """Fault-injection seams (``hooks.py``); read by the NIC threads at each request."""
        self.send_cv = threading.Condition(self.lock)
        self.recv_cv = threading.Condition(self.lock)
        self.tx_lock = threading.Lock()
        self.rx_lock = threading.Lock()
        self.tx_io = threading.Lock()
        self.wire: deque[Chunk] = deque()
        self.send_stopped = False  # a request failed locally: nothing after it is sent
        self.tx_pending: PendingWrite | None = None  # written under tx_lock
        self.held = HeldIo()
        """The doorbell's non-blocking writes that keep the GIL (used under tx_lock)."""
        self.sock: socket.socket | None = None  # the active side's connection
        self.responder: Stoppable | None = None  # the passive side's
        self.retry_timeout = retry_timeout
        """The silence timeout: also the base of a response's deadline once it came short."""
        self.aborted = False  # a local region one of its socket calls held was deregistered

    def use_hooks(self, hooks: Hooks | None) -> None:
        """Act on this pair's requests through ``hooks`` from now on (None: none)."""
        self.hooks = hooks

    def writing(self) -> bool:
        """A round or a doorbell may be in a socket call that holds the socket's lock: no receive
        that keeps the GIL now. (One that starts right after this answered False can still make a
        receive wait once, for one call: rare, and no worse than without the check.)"""
        return self.tx_lock.locked()

    # -- the two sides ------------------------------------------------------------------

    def connected_locked(self, sock: socket.socket) -> None:
        """The active side dialled its peer: ``sock`` carries this pair from now on."""
        self.sock = sock
        self.ready_locked()

    def attach(self, responder: Stoppable) -> bool:
        """The dial carrying our token arrived; False if this pair is gone or taken meanwhile."""
        with self.lock:
            if self.closed or self.state != _RTS or self.responder is not None:
                return False
            self.responder = responder
            return True

    def responder_done(self) -> None:
        """The passive pair's connection ended: the pair is unusable from now on."""
        self.passive_ended()

    # -- posting and sending ----------------------------------------------------------

    def sender_idle_locked(self) -> bool:
        """Nothing for the sender thread to send: nothing parked, and no span untaken (or a local
        failure stopped sending). The sender waits while this holds."""
        return self.tx_pending is None and (self.send_stopped or not self.pending)

    def may_ring_locked(self) -> bool:
        """A post may write to the socket itself (the doorbell): the sender is idle with nothing
        untaken and no local failure, and the pair has no hooks (a hooked pair's requests all go
        through the sender thread)."""
        return self.sender_idle_locked() and not self.pending and not self.send_stopped and self.hooks is None

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
                total += span.batch.length.item(span.pos) if end == span.pos + 1 else span.payload_to(end)
            span.pos = end
            if end == len(span.batch):
                self.pending.popleft()
        self.wire.extend(chunks)
        return chunks

    def take_one_locked(self, batch: WorkBatch) -> Chunk:
        """Admit the single request of ``batch`` and put it on the wire as sent, in one step (the
        doorbell's single read or write, checked already; the caller holds ``tx_lock`` and found
        the sender idle and the pair in RTS)."""
        seq = self.posted
        self.posted = seq + 1
        chunk = Chunk(batch, 0, 1, seq)
        chunk.sent = True
        wire = self.wire
        wire.append(chunk)
        if wire[0] is chunk:
            self.recv_cv.notify()  # the receiver waits only while the head is unsent
        return chunk

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

    def complete_locked(self, chunk: Chunk, k: int) -> None:
        """Requests ``chunk.next`` to ``chunk.next + k`` succeeded (``chunk`` is the head)."""
        a = chunk.next
        b = a + k
        chunk.next = b
        if b == chunk.hi:
            self.wire.popleft()
        self.succeeded_locked(chunk.batch, a, b)

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

    def finish_response_locked(self, head: Chunk, done: int, status: int, vendor: int) -> bool:
        """The head chunk's response (or a hook's verdict on it): its first ``done`` requests
        succeeded, and with a non-zero ``status`` the next one failed. True while the receiver
        goes on (the pair is still in RTS)."""
        if self.state != _RTS:
            return False  # flushed meanwhile (to_error, close)
        if done:
            self.complete_locked(head, done)
        if status:
            self.fail_locked(WcStatus.parse(status), vendor)
            return False
        self.complete_presets_locked()
        return self.state == _RTS

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

    def quiesce_locked(self) -> None:
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

    def unfinished_locked(self) -> Iterator[tuple[WorkBatch, int, int | None]]:
        for chunk in self.wire:
            yield chunk.batch, chunk.next, chunk.hi
        yield from super().unfinished_locked()

    def clear_locked(self) -> None:
        self.wire.clear()
        super().clear_locked()
