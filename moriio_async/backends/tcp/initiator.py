"""The active side's two NIC threads: a sender and a receiver per queue pair.

The sender takes posted requests in order, checks their local SGEs, and
writes each as one header plus (for a WRITE) the source memoryviews, batching
several requests into one ``sendmsg``. The receiver reads responses in order,
scatters READ payloads straight into the local SGEs, and completes requests
at the head of the pair's ``inflight`` deque. Both block in socket calls that
release the GIL; both exit when the pair leaves RTS (the error path shuts the
socket down, which wakes them).
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import TYPE_CHECKING

from ...status import Opcode, WcStatus
from ..base import QpState
from .hooks import Fault
from .regions import TcpRegion
from .wire import REQUEST, RESPONSE, PeerGone, VendorErr, drain, peer_progress, recv_exact, recv_scatter, send_all

if TYPE_CHECKING:
    from .qp import Entry, TcpQueuePair

__all__ = ["start_initiator"]

log = logging.getLogger("moriio_async.tcp")

IOV_LIMIT = 1000  # below IOV_MAX (1024): one sendmsg carries a whole batch
BATCH_BYTES = 4 << 20
LOOKAHEAD = 64  # responses read with one recv when they are all WRITE acks
SCRATCH = 1 << 16

_RTS = QpState.RTS
_WRITE = int(Opcode.RDMA_WRITE)


def start_initiator(qp: TcpQueuePair, sock: socket.socket) -> list[threading.Thread]:
    threads = [
        threading.Thread(target=_guard, args=(qp, _send_loop, sock), name=f"moriio-tcp-send-{qp.qp_num}"),
        threading.Thread(target=_guard, args=(qp, _recv_loop, sock), name=f"moriio-tcp-recv-{qp.qp_num}"),
    ]
    for t in threads:
        t.daemon = True
        t.start()
    return threads


def _guard(qp: TcpQueuePair, loop: object, sock: socket.socket) -> None:
    """Run a NIC loop; an unexpected error becomes completions, never a thread exception."""
    try:
        loop(qp, sock)  # type: ignore[operator]
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


def _take_batch(qp: TcpQueuePair) -> list[Entry] | None:
    """Wait for posted requests; None once the pair has left RTS."""
    with qp.lock:
        to_send = qp.to_send
        while not to_send and qp.state == _RTS:
            qp.send_cv.wait()
        if qp.state != _RTS:
            return None
        batch = [to_send.popleft()]
        niov = 1 + len(batch[0].wr.sges)
        nbytes = batch[0].length
        while to_send and nbytes < BATCH_BYTES:
            k = 1 + len(to_send[0].wr.sges)
            if niov + k > IOV_LIMIT:
                break
            e = to_send.popleft()
            batch.append(e)
            niov += k
            nbytes += e.length
        return batch


def _send_loop(qp: TcpQueuePair, sock: socket.socket) -> None:
    pack = REQUEST.pack
    header = REQUEST.size
    while True:
        batch = _take_batch(qp)
        if batch is None:
            return
        hooks = qp.hooks
        iov: list[bytes | memoryview] = []
        total = 0
        pinned: list[TcpRegion] = []
        stop = False
        try:
            for e in batch:
                wr = e.wr
                if hooks is not None:
                    verdict = hooks.on_send(qp.qp_num, wr)
                    if verdict is Fault.DROP:
                        qp.peer_lost(VendorErr.HOOK)
                        return
                    if isinstance(verdict, WcStatus):
                        qp.preset(e, verdict, 0 if verdict is WcStatus.SUCCESS else VendorErr.HOOK)
                        if verdict is not WcStatus.SUCCESS:
                            stop = True
                            break
                        continue
                err = _resolve(qp, e, pinned)
                if err is not None:
                    # Requests before it still go out and complete first; nothing after it is sent.
                    qp.preset(e, WcStatus.LOC_PROT_ERR, err)
                    stop = True
                    break
                e.sent = True
                iov.append(pack(wr.opcode, 0, 0, e.seq, wr.rkey, 0, wr.remote_addr, e.length))
                total += header
                if not e.is_read:
                    iov.extend(e.views)
                    total += e.length
            if iov:
                send_all(sock, iov, total)
        except PeerGone as exc:
            qp.peer_lost(exc.vendor)
            return
        finally:
            for region in pinned:
                region.unpin()
        if stop:
            return  # the pair enters ERR when the preset request reaches the head


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
            # payload follows its header, and must go straight into its SGEs.
            n = 0
            for e in inflight:
                n += 1
                if e.is_read or not e.sent or n == LOOKAHEAD:
                    break
        try:
            got = _recv_headers(sock, view, n * size, size)
            for i in range(got // size):
                op, status, vendor, seq, length = unpack(buf, i * size)
                if not _on_response(qp, sock, scratch, op, status, vendor, seq, length):
                    return
        except PeerGone as exc:
            qp.peer_lost(exc.vendor)
            return


def _recv_headers(sock: socket.socket, view: memoryview, limit: int, size: int) -> int:
    """Read at least one whole response header, at most ``limit`` bytes; a whole number of headers."""
    acked: int | None = None
    while True:
        try:
            got = sock.recv_into(view, limit)
            break
        except BlockingIOError:
            # No response for retry_timeout. A peer still taking in a long WRITE's payload
            # is not silent: wait on while the bytes it has acknowledged keep growing.
            acked, progressing = peer_progress(sock, acked)
            if not progressing:
                raise PeerGone(VendorErr.PEER_SILENT) from None
        except OSError:
            raise PeerGone(VendorErr.PEER_RESET) from None
    if not got:
        raise PeerGone(VendorErr.PEER_CLOSED)
    partial = got % size
    if partial:
        recv_exact(sock, view[got : got + size - partial])
        got += size - partial
    return got


def _on_response(
    qp: TcpQueuePair,
    sock: socket.socket,
    scratch: memoryview,
    op: int,
    status: int,
    vendor: int,
    seq: int,
    length: int,
) -> bool:
    """Complete the head request from its response; False when the receiver should stop."""
    with qp.lock:
        if qp.state != _RTS:
            return False
        head = qp.inflight[0] if qp.inflight else None
        if head is None or seq != head.seq or op != head.wr.opcode:
            qp.fail_locked(WcStatus.BAD_RESP_ERR, VendorErr.BAD_RESPONSE)
            return False
        if not status and op == _WRITE and qp.hooks is None:
            # The hot path: a WRITE ack, completed under the one lock acquisition.
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
            err = _recv_read_payload(qp, sock, head, scratch)
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
