"""The active side's receiver: responses off the wire, chunks completed in order.

A response completes a range of the head chunk at once (``PairState.complete_locked``).
WRITE responses are headers only, so several are read with one ``recv``. A READ
chunk's one response is its header followed by the payloads of the requests
that succeeded: header and payloads land with one ``recvmsg`` straight into the
local SGEs, with the chunk's local regions pinned. The thread blocks in socket
calls with the GIL released and exits when the pair leaves RTS (the error path
shuts the socket down, which wakes it).

A response that comes short (its first call did not bring it whole) is due
within one total deadline from then (``iov.Deadline``: ``retry_timeout`` plus
its payload at ``MIN_RATE``), so a target that sends a byte now and then
cannot hold the thread, or the local regions it lands in, for longer.
"""

from __future__ import annotations

import functools
import socket
from collections.abc import Callable

import numpy as np

from ...status import Opcode, WcStatus
from ...work import WorkRequest
from ..base import QpState
from .hooks import Fault
from .iov import (
    Deadline,
    HeldIo,
    address,
    advance,
    advance_buffers,
    iovecs,
    prefix,
    recv_all,
    recv_buffers,
    recv_exact,
    recvmsg,
)
from .pairstate import Chunk, PairState
from .wire import RESPONSE, PeerGone, VendorErr, peer_progress

__all__ = ["recv_loop"]

LOOKAHEAD = 64  # WRITE responses read with one recv
HELD_BYTES = 128 << 10
"""A READ response up to this size is first taken keeping the GIL (``HeldIo``); a larger one is
received with one MSG_WAITALL call (GIL released), which a partial first take would only split."""
SCRATCH = 1 << 16

_RTS = QpState.RTS
_WAITALL = int(socket.MSG_WAITALL)
_WRITE = int(Opcode.RDMA_WRITE)
_SIZE = RESPONSE.size
Response = tuple[int, int, int, int, int, int, int]  # opcode, status, vendor, seq, done, reserved, payload


def recv_loop(st: PairState, sock: socket.socket) -> None:
    responses = np.zeros(_SIZE * LOOKAHEAD, dtype=np.uint8)
    buf = view = responses.data
    at = address(responses)
    header = np.zeros(_SIZE, dtype=np.uint8)
    header_at = address(header)  # once: numpy's address lookup costs microseconds
    scratch = memoryview(bytearray(SCRATCH))
    held = HeldIo()
    fd = sock.fileno()
    while True:
        with st.lock:
            wire = st.wire
            while st.state == _RTS and not (wire and wire[0].sent):
                st.recv_cv.wait()
            if st.state != _RTS:
                return
            head = wire[0]
            n = 1
            if not head.is_read:  # count the sent WRITE chunks that answer before anything else
                while n < min(len(wire), LOOKAHEAD) and (c := wire[n]).sent and not c.is_read and c.preset is None:
                    n += 1
        try:
            if head.is_read:
                if not _read_chunk(st, sock, head, header, header_at, scratch, held):
                    return
                continue
            # What already arrived is taken keeping the GIL; only an empty socket, or one being
            # written, is waited on with the GIL released.
            got = _held_recv(st, held, fd, [(at, n * _SIZE)])
            if got <= 0:
                got = _patient(sock, functools.partial(sock.recv_into, view, n * _SIZE))
            if got % _SIZE:
                deadline = Deadline.after(sock, st.retry_timeout, 0)
                recv_exact(sock, view[got : got + _SIZE - got % _SIZE], deadline)
                deadline.end()
                got += _SIZE - got % _SIZE
            for i in range(got // _SIZE):
                if not _on_write_response(st, RESPONSE.unpack_from(buf, i * _SIZE)):
                    return
        except PeerGone as exc:
            st.peer_lost(exc.vendor)
            return


def _held_recv(st: PairState, held: HeldIo, fd: int, blocks: list[tuple[int, int]]) -> int:
    """``held.recv`` unless a write to the socket is under way (-1 then, as for an empty socket):
    the call would wait for the writer's hold on the socket with the GIL held (pairstate.py)."""
    return -1 if st.writing() else held.recv(fd, blocks)


def _patient(sock: socket.socket, call: Callable[[], int]) -> int:
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


def _valid(head: Chunk, r: Response) -> bool:
    op, status, _vendor, seq, done, _reserved, payload = r
    if op != head.opcode or seq != head.wire_seq(head.next) or done > head.hi - head.next:
        return False
    if status and done == head.hi - head.next:
        return False  # the failed request must be one of the chunk's
    if not status and done != head.hi - head.next and (head.is_read or not done):
        return False  # a success covers something; a READ chunk is answered whole
    expect = _payload(head, head.next, head.next + done) if head.is_read else 0
    return payload == expect


def _payload(chunk: Chunk, a: int, b: int) -> int:
    lengths = chunk.batch.length
    return lengths.item(a) if b == a + 1 else int(lengths[a:b].sum())


def _on_write_response(st: PairState, r: Response) -> bool:
    """Complete what a WRITE chunk's response covers; False to stop."""
    _op, status, vendor, _seq, done, _reserved, _payload_bytes = r
    with st.lock:
        if st.state != _RTS:
            return False
        head = st.wire[0] if st.wire else None
        if head is None or head.preset is not None or not head.sent or head.is_read or not _valid(head, r):
            st.fail_locked(WcStatus.BAD_RESP_ERR, VendorErr.BAD_RESPONSE)
            return False
        if st.hooks is None:
            return st.finish_response_locked(head, done, status, vendor)
        wr = head.batch.request(head.next)  # a hooked pair's chunks hold one request
    return _hooked(st, head, wr, status, vendor)


def _hooked(st: PairState, head: Chunk, wr: WorkRequest, status: int, vendor: int) -> bool:
    """A hooked pair: ``on_response`` sees the one request's outcome and may change it."""
    hooks = st.hooks
    wc_status, err = (WcStatus.parse(status), vendor) if status else (WcStatus.SUCCESS, 0)
    if hooks is not None:
        verdict = hooks.on_response(st.qp_num, wr, wc_status)
        if verdict is Fault.DROP:
            st.peer_lost(VendorErr.HOOK)
            return False
        if isinstance(verdict, WcStatus):
            wc_status, err = verdict, (0 if verdict is WcStatus.SUCCESS else VendorErr.HOOK)
    done = head.hi - head.next if wc_status is WcStatus.SUCCESS else 0  # the whole chunk: one request
    with st.lock:
        return st.finish_response_locked(head, done, wc_status, err)


def _read_chunk(
    st: PairState,
    sock: socket.socket,
    head: Chunk,
    header: np.ndarray,
    header_at: int,
    scratch: memoryview,
    held: HeldIo,
) -> bool:
    """Receive a READ chunk's response (header, then payloads into the local SGEs) and complete it."""
    local, scatter, views = head.local, head.iov, head.views
    assert local is not None
    fd = sock.fileno()
    lost: int | None = None  # the request a deregistered local region makes fail
    with st.rx_lock:
        if st.state != _RTS:
            return False
        local.pin(VendorErr.LOCAL_DEREGISTERED)
        nsge = len(views) if views is not None else len(scatter) if scatter is not None else 0
        try:
            if local.first_bad >= nsge:  # the common case (all alive): header and payloads in one call
                if views is not None:  # one request: the socket module's call, a view per SGE
                    buffers = [header.data, *views]
                    got = -1
                    blocks = head.blocks
                    if (
                        blocks is not None
                        and len(blocks) <= HeldIo.MAX_BLOCKS
                        and _payload(head, head.lo, head.hi) <= HELD_BYTES
                    ):
                        # What already arrived is taken keeping the GIL; only an empty socket, or one
                        # being written, is waited on.
                        got = _held_recv(st, held, fd, [(header_at, _SIZE), *blocks])
                    if got <= 0:
                        got = _patient(sock, lambda: sock.recvmsg_into(buffers, 0, _WAITALL)[0])
                else:
                    assert scatter is not None
                    iov = iovecs(1 + nsge)
                    iov[0] = (header_at, _SIZE)
                    iov[1:] = scatter
                    got = _patient(sock, lambda: recvmsg(fd, iov))
                _finish_header(st, sock, header, got)
                r: Response = RESPONSE.unpack_from(header.data)
                # No pair lock here: fail_locked takes it and then waits for rx_lock. Only this
                # thread moves the head chunk's fields, and a state read races as harmlessly.
                ok = st.state == _RTS and _valid(head, r)
                left = r[6] - max(0, got - _SIZE)
                if ok and left > 0:
                    deadline = Deadline.after(sock, st.retry_timeout, left)
                    if views is not None:
                        recv_buffers(sock, advance_buffers(buffers, got), left, deadline)
                    else:
                        start = advance(iov, 0, got)
                        recv_all(fd, prefix(iov, start, left), left, 0, deadline)
                    deadline.end()
            else:  # a local region died after the chunk was sent: drain what it would have received
                got = _patient(sock, lambda: sock.recv_into(header.data, _SIZE, _WAITALL))
                _finish_header(st, sock, header, got)
                r = RESPONSE.unpack_from(header.data)
                starts = head.batch.sge_start
                a = int(starts[head.lo])
                lost = int(np.searchsorted(starts[head.lo : head.hi + 1], a + local.first_bad, side="right")) - 1
                # No pair lock here: fail_locked takes it and then waits for rx_lock. Only this
                # thread moves the head chunk's fields, and a state read races as harmlessly.
                ok = st.state == _RTS and _valid(head, r)
                if ok:
                    keep = _payload(head, head.lo, head.lo + min(lost, r[4])) if min(lost, r[4]) else 0
                    deadline = Deadline.after(sock, st.retry_timeout, r[6])
                    if keep:
                        assert scatter is not None  # a one-request chunk keeps nothing when its region is gone
                        recv_all(fd, prefix(scatter, 0, keep), keep, 0, deadline)
                    _drain(sock, r[6] - keep, scratch, deadline)
                    deadline.end()
        finally:
            local.unpin()
    if not ok:
        st.fail(WcStatus.BAD_RESP_ERR, VendorErr.BAD_RESPONSE)
        return False
    _op, status, vendor, _seq, done, _reserved, _p = r
    if lost is not None and lost < done:
        done, status, vendor = lost, int(WcStatus.LOC_PROT_ERR), int(VendorErr.LOCAL_DEREGISTERED)
    if st.hooks is not None:
        return _hooked(st, head, head.batch.request(head.next), status, vendor)
    with st.lock:
        return st.finish_response_locked(head, done, status, vendor)


def _finish_header(st: PairState, sock: socket.socket, header: np.ndarray, got: int) -> None:
    if got < _SIZE:
        deadline = Deadline.after(sock, st.retry_timeout, 0)
        recv_exact(sock, header.data[got:], deadline)
        deadline.end()


def _drain(sock: socket.socket, nbytes: int, scratch: memoryview, deadline: Deadline) -> None:
    """Read and discard ``nbytes`` without touching any region (by ``deadline``)."""
    while nbytes > 0:
        chunk = scratch[: min(nbytes, len(scratch))]
        recv_exact(sock, chunk, deadline)
        nbytes -= len(chunk)
        if nbytes:
            deadline.check()
