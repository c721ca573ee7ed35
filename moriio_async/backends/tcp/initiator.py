"""The active side's two NIC threads: a sender and a receiver per queue pair.

The sender takes posted requests in order, checks their local SGEs, and
writes each as one header plus (for a WRITE) the source memoryviews, batching
several requests into one ``sendmsg``. The receiver reads responses in order,
scatters READ payloads straight into the local SGEs, and completes requests
from the head of the pair's ``inflight`` deque (a response also completes
the unanswered successful WRITEs before it: acks are coalesced). Both block in socket calls that
release the GIL; both exit when the pair leaves RTS (the error path shuts the
socket down, which wakes them).

The doorbell: when the sender is idle, ``post_send`` writes READs and small
WRITEs to the socket itself (``send_inline``, never blocking), which saves a
thread wakeup and a GIL hand-off per post; ``tx_lock`` orders the two writers.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ...status import Opcode, WcStatus
from ..base import QpState
from .hooks import Fault
from .regions import TcpRegion
from .wire import (
    FLAG_ACK,
    REQUEST,
    RESPONSE,
    PeerGone,
    VendorErr,
    advance,
    drain,
    peer_progress,
    recv_exact,
    recv_scatter,
    send_all,
)

if TYPE_CHECKING:
    from .qp import Entry, TcpQueuePair

__all__ = ["send_inline", "start_initiator"]

log = logging.getLogger("moriio_async.tcp")

IOV_LIMIT = 1000  # below IOV_MAX (1024): one sendmsg carries a whole batch
BATCH_BYTES = 4 << 20
LOOKAHEAD = 64  # responses read with one recv when they are all WRITE acks
SCRATCH = 1 << 16

_RTS = QpState.RTS
_WRITE = int(Opcode.RDMA_WRITE)
_READ = int(Opcode.RDMA_READ)


def start_initiator(qp: TcpQueuePair, sock: socket.socket) -> list[threading.Thread]:
    threads = [
        threading.Thread(target=_guard, args=(qp, _send_loop, sock), name=f"moriio-tcp-send-{qp.qp_num}"),
        threading.Thread(target=_guard, args=(qp, _recv_loop, sock), name=f"moriio-tcp-recv-{qp.qp_num}"),
    ]
    for t in threads:
        t.daemon = True
        t.start()
    return threads


def _guard(qp: TcpQueuePair, loop: Callable[[TcpQueuePair, socket.socket], None], sock: socket.socket) -> None:
    """Run a NIC loop; an unexpected error becomes completions, never a thread exception."""
    try:
        loop(qp, sock)
    except BaseException:
        log.exception("tcp qp %d: NIC thread failed", qp.qp_num)
        qp.fail(WcStatus.GENERAL_ERR, 0)


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


def _send_loop(qp: TcpQueuePair, sock: socket.socket) -> None:
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


def _recv_loop(qp: TcpQueuePair, sock: socket.socket) -> None:
    size = RESPONSE.size
    unpack = RESPONSE.unpack_from
    buf = bytearray(size * LOOKAHEAD)
    view = memoryview(buf)
    scratch = memoryview(bytearray(SCRATCH))
    while True:
        with qp.lock:
            inflight = qp.inflight
            while not inflight and qp.state == _RTS:
                qp.recv_cv.wait()
            if qp.state != _RTS:
                return
            # Read several responses at once only while they are WRITE acks: a READ's
            # payload follows its header, and must go straight into its SGEs. Count
            # only requests that will be answered (never read past a READ's header).
            n = 0
            first: Entry | None = None
            for e in inflight:
                if e.acked or not e.sent:
                    first = first or e
                    n += 1
                    if e.is_read or not e.sent or n == LOOKAHEAD:
                        break
        try:
            if n == 1 and first is not None and first.is_read and first.sent:
                # The next response is this READ's (or a failure, after which nothing
                # follows): header and payload in one scatter read.
                done = _recv_read_response(qp, sock, first, view[:size])
                if done is None:
                    return
                if done:
                    if not _on_response(qp, sock, scratch, *unpack(buf), payload_done=True):
                        return
                    continue
            got = _recv_headers(sock, view, max(n, 1) * size, size)
            for i in range(got // size):
                if not _on_response(qp, sock, scratch, *unpack(buf, i * size)):
                    return
        except PeerGone as exc:
            qp.peer_lost(exc.vendor)
            return


def _first_recv(sock: socket.socket, call: Callable[[], int]) -> int:
    """Run one receive call that waits for the peer's next response; at least one byte.

    On a receive timeout (retry_timeout with nothing) a peer still taking in a
    long WRITE's payload is not silent: wait on while the bytes it has
    acknowledged keep growing. Raises PeerGone.
    """
    acked: int | None = None
    while True:
        try:
            got = call()
        except BlockingIOError:
            acked, progressing = peer_progress(sock, acked)
            if not progressing:
                raise PeerGone(VendorErr.PEER_SILENT) from None
            continue
        except OSError:
            raise PeerGone(VendorErr.PEER_RESET) from None
        if not got:
            raise PeerGone(VendorErr.PEER_CLOSED)
        return got


def _recv_headers(sock: socket.socket, view: memoryview, limit: int, size: int) -> int:
    """Read at least one whole response header, at most ``limit`` bytes; a whole number of headers."""
    got = _first_recv(sock, lambda: sock.recv_into(view, limit))
    partial = got % size
    if partial:
        recv_exact(sock, view[got : got + size - partial])
        got += size - partial
    return got


def _recv_read_response(qp: TcpQueuePair, sock: socket.socket, e: Entry, header: memoryview) -> bool | None:
    """Receive READ ``e``'s response header into ``header`` and its payload into its SGEs.

    True: the header is in ``header`` and, if it announces ``e``'s payload, the
    payload has landed. False: a local region is gone, nothing was read (the
    caller takes the ordinary path, which drains the payload). None: the pair
    left RTS. Raises PeerGone.
    """
    size = len(header)
    with qp.rx_lock:
        if qp.state != _RTS:
            return None
        pinned: list[TcpRegion] = []
        try:
            for region in e.regions:
                if not region.pin():
                    return False
                pinned.append(region)
            buffers = [header, *e.views]
            got = _first_recv(sock, lambda: sock.recvmsg_into(buffers)[0])
            if got < size:
                recv_exact(sock, header[got:])
                got = size
            op, status, _vendor, seq, length = RESPONSE.unpack_from(header)
            if not status and op == _READ and seq == e.seq and length == e.length:
                if got - size < length:
                    recv_scatter(sock, advance(e.views, got - size), length - (got - size))
            elif got > size:
                # Payload bytes after a failure or a response that is not e's: the peer
                # broke the protocol; _on_response fails the pair on the header.
                RESPONSE.pack_into(header, 0, 0xFF, 0, 0, 0, 0)
        finally:
            for region in pinned:
                region.unpin()
    return True


def _on_response(
    qp: TcpQueuePair,
    sock: socket.socket,
    scratch: memoryview,
    op: int,
    status: int,
    vendor: int,
    seq: int,
    length: int,
    *,
    payload_done: bool = False,
) -> bool:
    """Complete the request ``seq`` names, and the unanswered WRITEs before it; False to stop.

    ``payload_done``: a READ's payload was already received with its header.
    """
    with qp.lock:
        if qp.state != _RTS:
            return False
        inflight = qp.inflight
        head = inflight[0] if inflight else None
        while head is not None and head.seq != seq:
            # Answered out of turn? Only a WRITE that asked for no answer may be passed:
            # it succeeded, since the target runs requests in order and answers failures.
            if head.preset is not None or not head.sent or head.acked:
                head = None
                break
            inflight.popleft()
            qp.complete_ok_locked(head)
            qp.drain_presets_locked()
            head = inflight[0] if inflight else None
        if head is None or op != head.wr.opcode:
            qp.fail_locked(WcStatus.BAD_RESP_ERR, VendorErr.BAD_RESPONSE)
            return False
        if not status and (op == _WRITE or payload_done) and qp.hooks is None:
            # The hot path: a WRITE ack, or a READ whose payload has landed (checked by
            # _recv_read_response), completed under the one lock acquisition.
            qp.inflight.popleft()
            qp.complete_ok_locked(head)
            qp.drain_presets_locked()
            return qp.state == _RTS
    if status:
        wc_status, vendor = WcStatus.parse(status), vendor
    else:
        wc_status, vendor = WcStatus.SUCCESS, 0
        if head.is_read:
            if length != head.length:
                qp.fail(WcStatus.BAD_RESP_ERR, VendorErr.BAD_RESPONSE)
                return False
            err = None if payload_done else _recv_read_payload(qp, sock, head, scratch)
            if err is not None:
                wc_status, vendor = WcStatus.LOC_PROT_ERR, err
    hooks = qp.hooks
    if hooks is not None:
        verdict = hooks.on_response(qp.qp_num, head.wr, wc_status)
        if verdict is Fault.DROP:
            qp.peer_lost(VendorErr.HOOK)
            return False
        if isinstance(verdict, WcStatus):
            wc_status, vendor = verdict, (0 if verdict is WcStatus.SUCCESS else VendorErr.HOOK)
    with qp.lock:
        if qp.state != _RTS:
            return False  # flushed meanwhile (to_error, close)
        if wc_status is not WcStatus.SUCCESS:
            qp.fail_locked(wc_status, vendor)
            return False
        qp.inflight.popleft()
        qp.complete_ok_locked(head)
        qp.drain_presets_locked()
        return qp.state == _RTS


def _recv_read_payload(qp: TcpQueuePair, sock: socket.socket, e: Entry, scratch: memoryview) -> VendorErr | None:
    """Scatter a READ response into ``e``'s SGEs; drain it if a local region died meanwhile."""
    with qp.rx_lock:
        if qp.state != _RTS:
            raise PeerGone(VendorErr.PEER_CLOSED)  # flushed: the error path is waiting for us
        pinned: list[TcpRegion] = []
        try:
            for region in e.regions:
                if not region.pin():
                    drain(sock, e.length, scratch)
                    return VendorErr.LOCAL_DEREGISTERED
                pinned.append(region)
            recv_scatter(sock, e.views, e.length)
        finally:
            for region in pinned:
                region.unpin()
    return None
