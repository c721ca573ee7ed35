"""The active side's receiver: responses off the wire, requests completed in order.

The receiver thread reads responses in order, scatters READ payloads straight
into the local SGEs, and completes requests from the head of the pair's
``inflight`` deque (a response also completes the unanswered successful
WRITEs before it: acks are coalesced). It blocks in socket calls with the
GIL released and exits when the pair leaves RTS (the error path shuts the
socket down, which wakes it).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

from ...status import Opcode, WcStatus
from ..base import QpState
from .hooks import Fault
from .regions import TcpRegion
from .wire import RESPONSE, PeerGone, VendorErr, advance, drain, peer_progress, recv_exact, recv_scatter

if TYPE_CHECKING:
    from .qp import Entry, TcpQueuePair

__all__ = ["recv_loop"]

LOOKAHEAD = 64  # responses read with one recv when they are all WRITE acks
SCRATCH = 1 << 16

_RTS = QpState.RTS
_WRITE = int(Opcode.RDMA_WRITE)
_READ = int(Opcode.RDMA_READ)


def recv_loop(qp: TcpQueuePair, sock: socket.socket) -> None:
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
