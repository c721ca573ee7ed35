"""The active side's sender: posted requests framed as chunks and written to the socket, in order.

A round takes the next chunks from the pair state (``PairState.take_locked``),
checks their local SGEs with a few array operations, frames every chunk's
header and descriptors into one buffer (column-wise), and writes headers and
WRITE payloads with one ``sendmsg`` per up to ``IOV_MAX`` blocks straight from
the registered buffers (``iov.py``); the call blocks with the GIL released.

The doorbell: when the sender is idle, ``post`` writes READs and small WRITEs
to the socket itself (``ring_locked`` frames them under the pair lock, ``ring``
writes them after it is released, never blocking), which saves a thread wakeup
and a GIL hand-off per post; ``tx_lock`` orders the two writers, and what the
socket does not take at once is finished by the sender thread.
"""

from __future__ import annotations

import logging
import socket
import struct
from dataclasses import dataclass

import numpy as np

from ...status import Opcode, WcStatus
from ...work import WorkBatch
from ..base import QpState
from .hooks import Fault
from .iov import HeldIo, Iov, address, advance, advance_buffers, iovecs, send_all, send_buffers, sendmsg
from .pairstate import Chunk, PairState, PendingWrite
from .regions import Checked
from .wire import CHUNK, DESC, SEQ_MASK, PeerGone, VendorErr

__all__ = [
    "INLINE_BYTES",
    "ROUND_BYTES",
    "Drop",
    "Round",
    "next_round",
    "ring",
    "ring_locked",
    "ring_one_locked",
    "send_loop",
]

log = logging.getLogger("moriio_async.tcp")

ROUND_BYTES = 4 << 20
"""WRITE payload per round: one round's completions and slot releases are not held back by a huge one."""
INLINE_BYTES = 64 << 10
"""WRITE payload a post may send itself (on the poster's thread)."""

_DESC1 = struct.Struct("<IIQQ")  # one descriptor, for single-request chunks (no array work)
_HEAD1 = struct.Struct("<BBHIII" + "IIQQ")  # a chunk header with its one descriptor
_SMALL_SGES = 4  # a one-request round with at most this many SGEs uses the socket module's own calls
_RTS = QpState.RTS
_READ = int(Opcode.RDMA_READ)
_WRITE = int(Opcode.RDMA_WRITE)
_DONTWAIT = int(socket.MSG_DONTWAIT)
_NOSIGNAL = int(socket.MSG_NOSIGNAL)
Presets = dict[int, tuple[int, WcStatus, int]]


class Drop(Exception):
    """A fault hook asked to cut the connection."""


@dataclass
class Round:
    """One write to the socket: headers and payloads as an iovec list (or, for one small request,
    as buffers), and what must stay alive until it is out."""

    iov: Iov | None
    buffers: list[bytes | memoryview] | None
    total: int
    pinned: list[Checked]
    heads: np.ndarray | None  # the chunk headers the iovecs point at
    blocks: list[tuple[int, int]] | None = None
    """With ``buffers``: the payload's (address, length) pairs, for ``HeldIo.send``."""

    def unpin(self) -> None:
        for checked in self.pinned:
            checked.unpin()
        self.pinned.clear()


Out = list[tuple[Chunk, int, int, int, Checked]]


def _check_into(st: PairState, chunks: list[Chunk], pinned: list[Checked]) -> tuple[Out, Presets]:
    """Hooks and local checks: what goes on the wire (chunk, hi, first SGE, end SGE, its check),
    the pins held for WRITE payloads, and the requests that get their outcome without the wire."""
    hooks = st.hooks
    out: Out = []
    presets: Presets = {}
    for k, chunk in enumerate(chunks):
        batch, lo, hi = chunk.batch, chunk.lo, chunk.hi
        if hooks is not None:  # a hooked pair's chunks hold one request
            verdict = hooks.on_send(st.qp_num, batch.request(lo))
            if verdict is Fault.DROP:
                raise Drop
            if isinstance(verdict, WcStatus):
                presets[k] = (lo, verdict, 0 if verdict is WcStatus.SUCCESS else VendorErr.HOOK)
                if verdict is not WcStatus.SUCCESS:
                    break
                continue
        starts = batch.sge_start
        a, b = int(starts[lo]), int(starts[hi])
        if b - a == 1:
            lkey, addr, length = batch.sge_lkey.item(a), batch.sge_addr.item(a), batch.sge_length.item(a)
            checked = st.regions.check_local_one(lkey, addr, length, write=chunk.is_read)
        else:
            lkeys, addrs, lengths = batch.sge_lkey[a:b], batch.sge_addr[a:b], batch.sge_length[a:b]
            checked = st.regions.check_local(lkeys, addrs, lengths, write=chunk.is_read)
        checked.holder = st  # deregistering the region aborts this pair's socket call on it
        if not chunk.is_read:
            checked.pin(VendorErr.LOCAL_DEREGISTERED)  # held while the payload is on its way out
            pinned.append(checked)
        else:
            chunk.local = checked
        if checked.first_bad < b - a:
            # Requests before it still go out and complete first; nothing after it is sent.
            bad = lo + int(np.searchsorted(starts[lo : hi + 1], a + checked.first_bad, side="right")) - 1
            presets[k] = (bad, WcStatus.LOC_PROT_ERR, checked.vendor)
            if bad > lo:
                out.append((chunk, bad, a, int(starts[bad]), checked))
            break
        out.append((chunk, hi, a, b, checked))
    return out, presets


def _check(st: PairState, chunks: list[Chunk]) -> tuple[Out, list[Checked], Presets]:
    """``_check_into`` that never leaves a region pinned when it raises (a Drop, or a bug)."""
    pinned: list[Checked] = []
    try:
        out, presets = _check_into(st, chunks, pinned)
    except BaseException:
        for checked in pinned:
            checked.unpin()
        raise
    return out, pinned, presets


def _frame_one(chunk: Chunk, a: int, b: int, checked: Checked) -> Round:
    """A one-request chunk as socket-module buffers: header and descriptor in one ``bytes``, then
    (WRITE) views of its SGEs, and the same SGEs as (address, length) pairs; a READ keeps both for
    the receiver."""
    batch, lo = chunk.batch, chunk.lo
    length = batch.length.item(lo)
    head = _HEAD1.pack(chunk.opcode, 0, 0, chunk.wire_seq(lo), 1, 0, batch.rkey.item(lo), 0,
                       batch.remote_addr.item(lo), length)  # fmt: skip
    views: list[memoryview] = []
    blocks: list[tuple[int, int]] = []
    for j in range(a, b):
        region = checked.found[int(checked.which[j - a]) if len(checked.found) > 1 else 0]
        assert region is not None
        addr, size = batch.sge_addr.item(j), batch.sge_length.item(j)
        off = addr - region.addr
        views.append(region.view[off : off + size])
        blocks.append((addr, size))
    if chunk.is_read:
        chunk.views = views
        chunk.blocks = blocks
        return Round(None, [head], len(head), [], None, [])
    return Round(None, [head, *views], len(head) + length, [], None, blocks)


def _frame(out: Out) -> tuple[Iov, int, np.ndarray]:
    """One buffer of chunk headers and descriptors, and the iovec list: each header followed by
    its WRITE payload blocks. READ chunks keep their scatter list for the receiver."""
    head_bytes = sum(CHUNK.size + DESC.itemsize * (hi - c.lo) for c, hi, _a, _b, _c in out)
    rows = sum(1 + (0 if c.is_read else b - a) for c, _hi, a, b, _c in out)
    heads = np.empty(head_bytes, dtype=np.uint8)
    iov = iovecs(rows)
    base = address(heads)
    hv = heads.data
    off = row = 0
    total = head_bytes
    for chunk, hi, a, b, _checked in out:
        batch, lo = chunk.batch, chunk.lo
        m = hi - lo
        size = CHUNK.size + DESC.itemsize * m
        CHUNK.pack_into(hv, off, chunk.opcode, 0, 0, chunk.wire_seq(lo), m, 0)
        if m == 1:
            _DESC1.pack_into(hv, off + CHUNK.size, batch.rkey.item(lo), 0, batch.remote_addr.item(lo),
                             batch.length.item(lo))  # fmt: skip
        else:
            desc = heads[off + CHUNK.size : off + size].view(DESC)
            desc["rkey"] = batch.rkey[lo:hi]
            desc["reserved"] = 0
            desc["addr"] = batch.remote_addr[lo:hi]
            desc["length"] = batch.length[lo:hi]
        iov[row, 0] = base + off
        iov[row, 1] = size
        row += 1
        off += size
        if chunk.is_read:
            chunk.iov = iovecs(b - a)
            chunk.iov[:, 0] = batch.sge_addr[a:b]
            chunk.iov[:, 1] = batch.sge_length[a:b]
        elif b > a:
            iov[row : row + b - a, 0] = batch.sge_addr[a:b]
            iov[row : row + b - a, 1] = batch.sge_length[a:b]
            row += b - a
            total += int(batch.sge_length[a:b].sum()) if b - a > 1 else batch.sge_length.item(a)
    return iov, total, heads


def _build(st: PairState, chunks: list[Chunk]) -> tuple[Round, Presets, bool]:
    """Check and frame taken chunks: the round, the presets, and whether anything goes out."""
    out, pinned, presets = _check(st, chunks)
    try:
        return _frame_round(out, pinned, presets)
    except BaseException:
        for checked in pinned:
            checked.unpin()
        raise


def _frame_round(out: Out, pinned: list[Checked], presets: Presets) -> tuple[Round, Presets, bool]:
    if len(out) == 1 and out[0][1] - out[0][0].lo == 1 and out[0][3] - out[0][2] <= _SMALL_SGES:
        chunk, _hi, a, b, checked = out[0]
        rnd = _frame_one(chunk, a, b, checked)
        rnd.pinned = pinned
        return rnd, presets, True
    if not out:
        return Round(None, None, 0, pinned, None), presets, False
    iov, total, heads = _frame(out)
    return Round(iov, None, total, pinned, heads), presets, True


def next_round(st: PairState, max_bytes: int) -> Round | None:
    """Take, check and frame the next chunks (the caller holds ``tx_lock``, not ``lock``). Raises Drop."""
    with st.lock:
        chunks = st.take_locked(max_bytes)
    if not chunks:
        return None
    rnd, presets, anything = _build(st, chunks)
    with st.lock:
        sending = st.settle_locked(chunks, presets)
    if not sending or not anything:
        rnd.unpin()
        return None
    return rnd


def send_loop(st: PairState, sock: socket.socket) -> None:
    """The sender thread: what a doorbell parked, then rounds, until the pair leaves RTS; then
    whatever is still parked is released here (its requests are flushed by the failure)."""
    try:
        _send_rounds(st, sock)
    finally:
        with st.tx_lock:
            st.drop_parked()


def _send_rounds(st: PairState, sock: socket.socket) -> None:
    fd = sock.fileno()
    while True:
        with st.lock:
            # After a local failure nothing new is sent (the pair enters ERR when it reaches the
            # head), but a write a doorbell parks meanwhile still goes out: the requests before
            # the failure are in it. So the thread lives until the pair leaves RTS.
            while st.state == _RTS and st.sender_idle_locked():
                st.send_cv.wait()
            if st.state != _RTS:
                return
        with st.tx_lock:
            try:
                left = st.take_parked()
                if left is not None:  # what a doorbell could not write without blocking goes first
                    with st.tx_io:
                        try:
                            if left.buffers is not None:
                                send_buffers(sock, left.buffers, left.left)
                            elif left.iov is not None:
                                send_all(fd, left.iov, left.left, left.start)
                        finally:
                            left.release()
                rnd = next_round(st, ROUND_BYTES)
                if rnd is not None:
                    with st.tx_io:
                        try:
                            if rnd.buffers is not None:
                                send_buffers(sock, rnd.buffers, rnd.total)
                            elif rnd.iov is not None:
                                send_all(fd, rnd.iov, rnd.total)
                        finally:
                            rnd.unpin()
            except Drop:
                st.peer_lost(VendorErr.HOOK)
                return
            except PeerGone as exc:
                st.peer_lost(exc.vendor)
                return


def ring_locked(st: PairState) -> Round | None:
    """The doorbell, first half: take, check and frame what was just posted, on the posting thread.

    The caller holds ``lock`` and ``tx_lock`` (taken without waiting), found the
    sender idle and the pair without hooks (so nothing here sleeps). It then
    releases ``lock`` and writes the round with ``ring`` while still holding
    ``tx_lock``: the socket call never runs under the pair lock, which the
    receiver needs for every completion.
    """
    chunks = st.take_locked(INLINE_BYTES)
    if not chunks:
        return None
    try:
        rnd, presets, anything = _build(st, chunks)
    except Exception:
        log.exception("tcp qp %d: posting failed", st.qp_num)
        st.fail_locked(WcStatus.GENERAL_ERR, 0)  # what was taken completes (flushed), nothing hangs
        return None
    if not st.settle_locked(chunks, presets) or not anything:
        rnd.unpin()
        return None
    return rnd


def ring_one_locked(st: PairState, batch: WorkBatch) -> Round | None:
    """The doorbell for the single read or write (one request, one SGE, an idle sender): admit,
    take, check, frame and settle it at once, without the span, the presets and the chunk list of
    the general path. None (nothing changed) when it is not that case or its local check fails: the
    general path then takes it and reports the failure as it always does.

    The caller holds ``lock`` and ``tx_lock``, found the sender idle, the pair in RTS and without
    hooks, and writes the round with ``ring`` after releasing ``lock``.
    """
    op = batch.opcode.item(0)
    a = batch.sge_start.item(0)
    if batch.sge_start.item(1) - a != 1:
        return None
    length = batch.length.item(0)
    is_read = op == _READ
    if not is_read and (op != _WRITE or length > INLINE_BYTES):
        return None
    addr, size = batch.sge_addr.item(a), batch.sge_length.item(a)
    checked = st.regions.check_local_one(batch.sge_lkey.item(a), addr, size, write=is_read)
    if not checked.first_bad:
        return None
    checked.holder = st  # deregistering the region aborts this pair's socket call on it
    if not is_read:
        checked.pin(VendorErr.LOCAL_DEREGISTERED)  # held while the payload is on its way out
        if not checked.first_bad:
            return None
    region = checked.found[0]
    assert region is not None
    chunk = st.take_one_locked(batch)
    head = _HEAD1.pack(op, 0, 0, chunk.seq & SEQ_MASK, 1, 0, batch.rkey.item(0), 0, batch.remote_addr.item(0), length)
    off = addr - region.addr
    view = region.view[off : off + size]
    blocks = [(addr, size)]
    if is_read:
        chunk.local = checked
        chunk.views = [view]
        chunk.blocks = blocks
        return Round(None, [head], len(head), [], None, [])
    return Round(None, [head, view], len(head) + size, [checked], None, blocks)


def ring(st: PairState, sock: socket.socket, rnd: Round) -> None:
    """The doorbell, second half: write ``rnd`` without blocking (the caller holds ``tx_lock``, not
    ``lock``). What the socket does not take at once is left in ``st.tx_pending`` for the sender
    thread, which is woken. A one-request round is written keeping the GIL (``HeldIo``)."""
    try:
        if rnd.blocks is not None and len(rnd.blocks) <= HeldIo.MAX_BLOCKS:
            assert rnd.buffers is not None
            sent = max(0, st.held.send(sock.fileno(), rnd.buffers[0], rnd.blocks))  # type: ignore[arg-type]
        elif rnd.buffers is not None:
            sent = sock.sendmsg(rnd.buffers, (), _DONTWAIT | _NOSIGNAL)
        else:
            assert rnd.iov is not None
            sent = sendmsg(sock.fileno(), rnd.iov, 0, _DONTWAIT)
    except BlockingIOError:
        sent = 0
    except OSError:
        rnd.unpin()
        st.peer_lost(VendorErr.PEER_RESET)
        return
    if sent == rnd.total:
        rnd.unpin()
        return
    if rnd.buffers is not None:
        pending = PendingWrite(None, advance_buffers(rnd.buffers, sent), 0, rnd.total - sent, rnd.unpin, None)
    else:
        assert rnd.iov is not None
        start = advance(rnd.iov, 0, sent)
        pending = PendingWrite(rnd.iov, None, start, rnd.total - sent, rnd.unpin, rnd.heads)
    if not st.park(pending):
        pending.release()  # the pair failed meanwhile: its requests are flushed, the sender may be gone
