"""The active side's sender: posted requests onto the wire, in order.

The sender thread takes posted requests in order, checks their local SGEs,
and writes each as one header plus (for a WRITE) the source memoryviews,
batching several requests into one ``sendmsg``; the call blocks with the GIL
released, so the copy into the kernel runs beside the event loop.

The doorbell: when the sender is idle, ``post_send`` writes READs and small
WRITEs to the socket itself (``send_inline``, never blocking), which saves a
thread wakeup and a GIL hand-off per post; ``tx_lock`` orders the two writers,
and what the socket does not take at once is finished by the sender thread.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

from ...status import WcStatus
from ..base import QpState
from .hooks import Fault
from .regions import TcpRegion
from .wire import FLAG_ACK, REQUEST, PeerGone, VendorErr, advance, send_all

if TYPE_CHECKING:
    from .qp import Entry, TcpQueuePair

__all__ = ["send_inline", "send_loop"]

IOV_LIMIT = 1000  # below IOV_MAX (1024): one sendmsg carries a whole batch
BATCH_BYTES = 4 << 20

_RTS = QpState.RTS


def _resolve(qp: TcpQueuePair, e: Entry, pinned: list[TcpRegion]) -> VendorErr | None:
    """Check ``e``'s SGEs against the local regions and slice their views.

    A WRITE's regions are pinned here (into ``pinned``) for the send; a READ's
    are pinned by the receiver while the response payload is written.
    """
    check = qp.regions.check_local
    nic_writes = e.is_read
    views = e.views
    for sge in e.wr.sges:
        region = check(sge.lkey, sge.addr, sge.length, nic_writes)
        if isinstance(region, VendorErr):
            return region
        if not nic_writes:
            if not region.pin():
                return VendorErr.LOCAL_DEREGISTERED
            pinned.append(region)
        offset = sge.addr - region.addr
        views.append(region.view[offset : offset + sge.length])
        e.regions.append(region)
    return None


def _take_batch(qp: TcpQueuePair) -> list[Entry]:
    """The next requests to send, in order (the caller holds ``tx_lock``); maybe none."""
    with qp.lock:
        to_send = qp.to_send
        batch: list[Entry] = []
        niov = nbytes = 0
        while to_send and nbytes < BATCH_BYTES:
            e = to_send[0]
            k = 1 + len(e.wr.sges)
            if batch and niov + k > IOV_LIMIT:
                break
            batch.append(to_send.popleft())
            niov += k
            nbytes += 0 if e.is_read else e.length  # bytes this side sends
        return batch


def _build(
    qp: TcpQueuePair,
    batch: list[Entry],
    pinned: list[TcpRegion],
    preset: Callable[[Entry, WcStatus, int], None],
) -> tuple[list[bytes | memoryview], int, bool]:
    """The gather list for ``batch``: headers and WRITE payload views; and whether sending stops here.

    Raises _Drop when a fault hook cuts the connection.
    """
    hooks = qp.hooks
    pack = REQUEST.pack
    iov: list[bytes | memoryview] = []
    total = 0
    last, last_at = batch[0], 0
    stop = False
    for e in batch:
        wr = e.wr
        if hooks is not None:
            verdict = hooks.on_send(qp.qp_num, wr)
            if verdict is Fault.DROP:
                raise _Drop
            if isinstance(verdict, WcStatus):
                preset(e, verdict, 0 if verdict is WcStatus.SUCCESS else VendorErr.HOOK)
                if verdict is not WcStatus.SUCCESS:
                    stop = True
                    break
                continue
        err = _resolve(qp, e, pinned)
        if err is not None:
            # Requests before it still go out and complete first; nothing after it is sent.
            preset(e, WcStatus.LOC_PROT_ERR, err)
            stop = True
            break
        e.sent = True
        # A successful WRITE is acknowledged only when signaled (or hooked, so
        # on_response sees every request); the target runs requests in order,
        # so a later response vouches for it, and a failure is always answered.
        e.acked = e.is_read or wr.signaled or hooks is not None
        last, last_at = e, len(iov)
        iov.append(pack(wr.opcode, FLAG_ACK if e.acked else 0, 0, e.seq, wr.rkey, 0, wr.remote_addr, e.length))
        total += REQUEST.size
        if not e.is_read:
            iov.extend(e.views)
            total += e.length
    if iov and not last.acked:
        # The batch's last request is always answered: then every request on the
        # wire has a response coming after it, which the receiver's silence
        # timeout (a dead peer) relies on.
        last.acked = True
        wr = last.wr
        iov[last_at] = pack(wr.opcode, FLAG_ACK, 0, last.seq, wr.rkey, 0, wr.remote_addr, last.length)
    return iov, total, stop


class _Drop(Exception):
    """A fault hook asked to cut the connection."""


def send_loop(qp: TcpQueuePair, sock: socket.socket) -> None:
    while True:
        with qp.lock:
            while not qp.to_send and qp.tx_pending is None and qp.state == _RTS and not qp.send_stopped:
                qp.send_cv.wait()
            if qp.state != _RTS or (qp.send_stopped and qp.tx_pending is None):
                return  # after a local failure the pair enters ERR when it reaches the head
        pinned: list[TcpRegion] = []
        with qp.tx_lock:
            try:
                pending, qp.tx_pending = qp.tx_pending, None
                if pending is not None:  # what post_send could not write without blocking goes first
                    buffers, total, pinned = pending
                    send_all(sock, buffers, total)
                    _unpin(pinned)
                if qp.send_stopped:
                    continue
                batch = _take_batch(qp)
                if not batch:
                    continue
                iov, total, stop = _build(qp, batch, pinned, qp.preset)
                if iov:
                    send_all(sock, iov, total)
                if stop:
                    with qp.lock:
                        qp.send_stopped = True
            except _Drop:
                qp.peer_lost(VendorErr.HOOK)
                return
            except PeerGone as exc:
                qp.peer_lost(exc.vendor)
                return
            finally:
                _unpin(pinned)


def _unpin(pinned: list[TcpRegion]) -> None:
    for region in pinned:
        region.unpin()
    pinned.clear()


def send_inline(qp: TcpQueuePair, sock: socket.socket) -> None:
    """Send what was just posted from the posting thread, without blocking (the doorbell).

    The caller (``post_send``) holds ``qp.lock`` and ``qp.tx_lock``, found the
    sender idle with nothing pending, no hooks, and little WRITE payload. What
    the socket does not take at once is left in ``qp.tx_pending`` for the
    sender thread, which the caller then wakes. Saves a thread wakeup per
    post for READs and small WRITEs; large payloads stay on the sender thread.
    """
    batch = list(qp.to_send)
    qp.to_send.clear()
    pinned: list[TcpRegion] = []
    iov, total, stop = _build(qp, batch, pinned, qp.preset_locked)
    if stop:
        qp.send_stopped = True
    if not iov:
        _unpin(pinned)
        return
    try:
        sent = sock.sendmsg(iov, (), socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
    except BlockingIOError:
        sent = 0
    except OSError:
        _unpin(pinned)
        qp.fail_locked(WcStatus.RETRY_EXC_ERR, VendorErr.PEER_RESET)
        return
    if sent == total:
        _unpin(pinned)
    else:
        qp.tx_pending = (advance(iov, sent), total - sent, pinned)
