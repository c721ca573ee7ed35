"""The active side's sender: posted requests framed as chunks and written to the socket, in order.

A round takes the next chunks from the pair state (``PairState.take_locked``),
checks their local SGEs with a few array operations, frames every chunk's
header and descriptors into one buffer (column-wise), and writes headers and
WRITE payloads with one ``sendmsg`` per up to ``IOV_MAX`` blocks straight from
the registered buffers (``iov.py``); the call blocks with the GIL released.

The doorbell: when the sender is idle, ``post`` writes READs and small WRITEs
to the socket itself (``ring``, never blocking), which saves a thread wakeup
and a GIL hand-off per post; ``tx_lock`` orders the two writers, and what the
socket does not take at once is finished by the sender thread.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

import numpy as np

from ...status import WcStatus
from ..base import QpState
from .hooks import Fault
from .iov import Iov, address, advance, iovecs, send_all, sendmsg
from .pairstate import Chunk, PairState, PendingWrite
from .regions import Checked
from .wire import CHUNK, DESC, PeerGone, VendorErr

__all__ = ["INLINE_BYTES", "ROUND_BYTES", "Drop", "Round", "next_round", "ring", "send_loop"]

ROUND_BYTES = 4 << 20
"""WRITE payload per round: one round's completions and slot releases are not held back by a huge one."""
INLINE_BYTES = 64 << 10
"""WRITE payload a post may send itself (on the poster's thread)."""

_DESC1 = struct.Struct("<IIQQ")  # one descriptor, for single-request chunks (no array work)
_RTS = QpState.RTS
Presets = dict[int, tuple[int, WcStatus, int]]


class Drop(Exception):
    """A fault hook asked to cut the connection."""


@dataclass
class Round:
    """One write to the socket: headers and payloads as an iovec list, and what must stay alive."""

    iov: Iov
    total: int
    pinned: list[Checked]
    heads: np.ndarray  # the chunk headers the iovecs point at

    def unpin(self) -> None:
        for checked in self.pinned:
            checked.unpin()
        self.pinned.clear()


def _check(st: PairState, chunks: list[Chunk]) -> tuple[list[tuple[Chunk, int, int, int]], list[Checked], Presets]:
    """Hooks and local checks: what goes on the wire (chunk, hi, first SGE, end SGE), the pins
    held for WRITE payloads, and the requests that get their outcome without the wire."""
    hooks = st.hooks
    out: list[tuple[Chunk, int, int, int]] = []
    pinned: list[Checked] = []
    presets: Presets = {}
    for k, chunk in enumerate(chunks):
        batch, lo, hi = chunk.batch, chunk.lo, chunk.hi
        if hooks is not None:  # a hooked pair's chunks hold one request
            verdict = hooks.on_send(st.qp_num, batch.request(lo))
            if verdict is Fault.DROP:
                for checked in pinned:
                    checked.unpin()
                raise Drop
            if isinstance(verdict, WcStatus):
                presets[k] = (lo, verdict, 0 if verdict is WcStatus.SUCCESS else VendorErr.HOOK)
                if verdict is not WcStatus.SUCCESS:
                    break
                continue
        starts = batch.sge_start
        a, b = int(starts[lo]), int(starts[hi])
        checked = st.regions.check_local(
            batch.sge_lkey[a:b], batch.sge_addr[a:b], batch.sge_length[a:b], write=chunk.is_read
        )
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
                out.append((chunk, bad, a, int(starts[bad])))
            break
        out.append((chunk, hi, a, b))
    return out, pinned, presets


def _frame(out: list[tuple[Chunk, int, int, int]]) -> tuple[Iov, int, np.ndarray]:
    """One buffer of chunk headers and descriptors, and the iovec list: each header followed by
    its WRITE payload blocks. READ chunks keep their scatter list for the receiver."""
    head_bytes = sum(CHUNK.size + DESC.itemsize * (hi - c.lo) for c, hi, _a, _b in out)
    rows = sum(1 + (0 if c.is_read else b - a) for c, _hi, a, b in out)
    heads = np.empty(head_bytes, dtype=np.uint8)
    iov = iovecs(rows)
    base = address(heads)
    hv = heads.data
    off = row = 0
    total = head_bytes
    for chunk, hi, a, b in out:
        batch, lo = chunk.batch, chunk.lo
        m = hi - lo
        size = CHUNK.size + DESC.itemsize * m
        CHUNK.pack_into(hv, off, chunk.opcode, 0, 0, chunk.wire_seq(lo), m, 0)
        if m == 1:
            _DESC1.pack_into(hv, off + CHUNK.size, int(batch.rkey[lo]), 0, int(batch.remote_addr[lo]),
                             int(batch.length[lo]))  # fmt: skip
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
            total += int(batch.sge_length[a:b].sum()) if b - a > 1 else int(batch.sge_length[a])
    return iov, total, heads


def next_round(st: PairState, max_bytes: int) -> Round | None:
    """Take, check and frame the next chunks (the caller holds ``tx_lock``). Raises Drop."""
    with st.lock:
        chunks = st.take_locked(max_bytes)
    if not chunks:
        return None
    out, pinned, presets = _check(st, chunks)
    iov, total, heads = _frame(out) if out else (iovecs(0), 0, np.zeros(0, np.uint8))
    rnd = Round(iov, total, pinned, heads)
    with st.lock:
        sending = st.settle_locked(chunks, presets)
    if not sending or not out:
        rnd.unpin()
        return None
    return rnd


def send_loop(st: PairState, sock: socket.socket) -> None:
    fd = sock.fileno()
    while True:
        with st.lock:
            while not st.pending and st.tx_pending is None and st.state == _RTS and not st.send_stopped:
                st.send_cv.wait()
            if st.state != _RTS or (st.send_stopped and st.tx_pending is None):
                return  # after a local failure the pair enters ERR when it reaches the head
        with st.tx_lock:
            rnd: Round | None = None
            try:
                left, st.tx_pending = st.tx_pending, None
                if left is not None:  # what a doorbell could not write without blocking goes first
                    try:
                        send_all(fd, left.iov, left.left, left.start)
                    finally:
                        left.release()
                rnd = next_round(st, ROUND_BYTES)
                if rnd is not None:
                    send_all(fd, rnd.iov, rnd.total)
            except Drop:
                st.peer_lost(VendorErr.HOOK)
                return
            except PeerGone as exc:
                st.peer_lost(exc.vendor)
                return
            finally:
                if rnd is not None:
                    rnd.unpin()


def ring(st: PairState, sock: socket.socket) -> None:
    """The doorbell: send what was just posted from the posting thread, without blocking.

    The caller holds ``tx_lock`` (taken without waiting) and found the sender
    idle. What the socket does not take at once is left in ``st.tx_pending``
    for the sender thread, which the caller then wakes.
    """
    try:
        rnd = next_round(st, INLINE_BYTES)
    except Drop:
        st.peer_lost(VendorErr.HOOK)
        return
    if rnd is None:
        return
    try:
        sent = sendmsg(sock.fileno(), rnd.iov, 0, socket.MSG_DONTWAIT)
    except BlockingIOError:
        sent = 0
    except OSError:
        rnd.unpin()
        st.peer_lost(VendorErr.PEER_RESET)
        return
    if sent == rnd.total:
        rnd.unpin()
        return
    st.tx_pending = PendingWrite(rnd.iov, advance(rnd.iov, 0, sent), rnd.total - sent, rnd.unpin, rnd.heads)
