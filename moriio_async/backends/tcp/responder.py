"""The passive side: serving one accepted data connection, playing the target's NIC.

Requests arrive as chunks (``wire.py``). A chunk's remote ranges are checked
together (rkey, bounds, access, region alive: ``RegionTable.check_remote``)
and its target regions pinned; a WRITE chunk's payloads are received with one
``recvmsg`` per up to IOV_MAX blocks straight into the target regions, a READ
chunk's response header and payloads go out with one ``sendmsg`` straight
from them. A violation touches no target byte: the requests before it run,
the response says REM_ACCESS_ERR for it, and service on the connection ends
(the rest of the stream is drained, for at most ``retry_timeout``), as a
verbs responder's QP enters the error state; the refusal is counted and
reported (``DataGuard.access_error``).

Every chunk has one total deadline from its first byte (``iov.Deadline``:
``retry_timeout`` plus its payload at ``MIN_RATE``), so a peer that spaces
its bytes out cannot hold the thread, or a pinned region, for longer.
Deregistering a region this responder is receiving into or sending from
calls ``abort`` (``regions.Abortable``): the socket is shut down, the call
returns at once, the region is unpinned, and an aborted WRITE is answered
with REM_ACCESS_ERR (REMOTE_DEREGISTERED) before service ends.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
import time

import numpy as np

from ...status import Opcode, WcStatus
from .guard import DataGuard
from .hooks import Fault, Hooks
from .iov import Deadline, address, iovecs, recv_all, recv_exact, send_all, send_buffers
from .pairstate import PairState
from .wire import CHUNK, DESC, MAX_CHUNK, RESPONSE, SEQ_MASK, PeerGone, VendorErr

__all__ = ["Responder"]

log = logging.getLogger("moriio_async.tcp")

SCRATCH = 1 << 16
_WRITE = int(Opcode.RDMA_WRITE)
_WAITALL = int(socket.MSG_WAITALL)
_READ = int(Opcode.RDMA_READ)
_REM_ACCESS_ERR = int(WcStatus.REM_ACCESS_ERR)
_FIRST = CHUNK.size + DESC.itemsize  # a chunk header and its first descriptor: read with one call
_DESC1 = struct.Struct("<IIQQ")
_HUNG_UP = frozenset({6, 7, 8, 9, 11})  # tcpi_state TIME_WAIT, CLOSE, CLOSE_WAIT, LAST_ACK, CLOSING: its FIN is in


class Responder:
    """One accepted connection: ``serve`` runs on the listener's thread for it; ``stop`` and ``abort``
    from anywhere."""

    def __init__(self, sock: socket.socket, guard: DataGuard, timeout: float) -> None:
        self.sock = sock
        self.guard = guard
        self.timeout = timeout
        """The silence timeout (``retry_timeout``): also the base of each message's deadline."""
        self.deadline = Deadline(sock, timeout)
        self._sock_lock = threading.Lock()  # stop() never races close() onto a reused fd; guards the two below
        self._stopped = False
        self._stop_event = threading.Event()
        self._writes = False  # the chunk being served is WRITEs: its regions are pinned to receive into
        self._moving = False  # between pinning a chunk's regions and the end of its socket call on them
        self._cut = False  # abort shut the socket during that call: the connection cannot go on
        self.thread: threading.Thread | None = None
        """The thread serving it (the listener's), joined by the backend's close."""

    def stop(self) -> None:
        """Wake the serving thread and end service (from any thread)."""
        with self._sock_lock:
            self._stopped = True
            self._shut_locked(socket.SHUT_RDWR)
        self._stop_event.set()

    def pause(self, seconds: float) -> bool:
        """Wait on the serving thread (``stop`` ends it early); False if stopped."""
        return not self._stop_event.wait(seconds)

    def abort(self) -> None:
        """A region this responder holds is being deregistered: end the socket call on it now.

        A receive is ended with a read shutdown (the response can still go out,
        saying REM_ACCESS_ERR); a send, with both directions shut. Called under
        the region's lock, so the pin is still held. Once the call has ended
        (its bytes are all in or out), nothing is shut: the chunk is answered as
        it went and the region is unpinned next, and service goes on unharmed.
        A shutdown then would leave a read-shut socket serving later chunks,
        whose refusal could be beaten by a reset (RETRY_EXC_ERR instead of
        REM_ACCESS_ERR).
        """
        with self._sock_lock:
            if not self._moving:
                return
            self._cut = True
            self.deadline.aborted = True
            self._shut_locked(socket.SHUT_RD if self._writes else socket.SHUT_RDWR)

    def _moving_begins(self) -> None:
        """Before a chunk's regions are pinned: from now until ``_moving_ends`` an abort shuts the socket."""
        with self._sock_lock:
            self._moving = True

    def _moving_ends(self) -> bool:
        """The socket call on the pinned regions ended; True if an abort cut the connection meanwhile
        (even a call that completed: the socket is shut, so the chunk is answered as aborted)."""
        with self._sock_lock:
            self._moving = False
            return self._cut

    def _shut_locked(self, how: int) -> None:
        if self.sock.fileno() >= 0:  # under _sock_lock: close() cannot have handed the fd on
            with contextlib.suppress(OSError):
                self.sock.shutdown(how)

    @property
    def stopped(self) -> bool:
        """``stop`` was called (the pair closed, or the backend): what ends service is not the peer's doing."""
        return self._stopped

    def join(self) -> None:
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join()

    def close(self) -> None:
        with self._sock_lock:
            self.sock.close()

    def serve(self, st: PairState) -> None:
        """Serve chunks in order until the connection ends or a request fails. Raises PeerGone."""
        sock = self.sock
        fd = sock.fileno()
        first = bytearray(_FIRST)
        first_view = memoryview(first)
        descs = np.zeros(MAX_CHUNK, dtype=DESC)
        desc_bytes = descs.data.cast("B")
        reply = np.zeros(RESPONSE.size, dtype=np.uint8)
        scratch = memoryview(bytearray(SCRATCH))
        deadline = self.deadline
        while self._read_first(sock, first_view):
            op, _flags, _r16, seq, count, _r32 = CHUNK.unpack_from(first)
            self._writes = op == _WRITE  # before any region is pinned for it (abort reads it)
            if (op != _WRITE and op != _READ) or not 1 <= count <= MAX_CHUNK:
                self.guard.bad_message(_host(sock), f"qp {st.qp_num}: malformed chunk (opcode {op}, {count} requests)")
                return
            hooks = st.hooks
            if count == 1 and (hooks is None or op == _READ):
                if not self._serve_one(st, hooks, op, seq, scratch, *_DESC1.unpack_from(first, CHUNK.size)):
                    return
                deadline.end()
                continue
            desc_bytes[: DESC.itemsize] = first_view[CHUNK.size :]
            if count > 1:
                recv_exact(sock, desc_bytes[DESC.itemsize : count * DESC.itemsize], deadline)
            d = descs[:count]
            if hooks is not None and op == _WRITE:
                if not self._write_hooked(st, hooks, fd, seq, d, scratch):
                    return
                deadline.end()
                continue
            if self._stopped:
                return
            self._moving_begins()
            checked = st.regions.check_remote(op, d["rkey"], d["addr"], d["length"], self)
            done = checked.first_bad
            aborted = cut = False
            if done < count:
                self._refused(st, op, d[done], checked.vendor)
            try:
                if hooks is not None:  # a READ chunk with hooks: every request it reaches, in order
                    for i in range(min(done + 1, count)):
                        rkey, _r, addr, length = (int(x) for x in d[i].tolist())
                        if hooks.on_request(st.qp_num, op, rkey, addr, length) is Fault.DROP or self._stopped:
                            return
                status, vendor = (0, 0) if done == count else (_REM_ACCESS_ERR, int(checked.vendor))
                if op == _WRITE:
                    received = self._receive(fd, d, done)
                    aborted = self._moving_ends() or not received
                    if not aborted:
                        _send_small(sock, RESPONSE.pack(op, status, vendor, seq, done, 0, 0))
                else:
                    payload = _fill(d, done, iov := iovecs(1 + done), 1)
                    RESPONSE.pack_into(reply.data, 0, op, status, vendor, seq, done, 0, payload)
                    iov[0] = (address(reply), RESPONSE.size)
                    send_all(fd, iov, RESPONSE.size + payload)
                    cut = self._moving_ends()  # sent whole, but the socket is shut: service ends
            finally:
                self._moving_ends()
                checked.unpin()
            if aborted:  # answered only now: the region's pin must end before anything else waits
                self._answer_abort(st, seq)
                return
            if cut:
                return
            if done < count:
                self._refuse_rest(sock, scratch)
                return
            deadline.end()

    def _serve_one(
        self, st: PairState, hooks: Hooks | None, op: int, seq: int, scratch: memoryview, rkey: int, _r: int,
        addr: int, length: int,
    ) -> bool:  # fmt: skip
        """A one-request chunk, with plain integers and the socket module's calls (a view of the
        target range); False when service ends."""
        sock = self.sock
        if hooks is not None and hooks.on_request(st.qp_num, op, rkey, addr, length) is Fault.DROP:
            return False
        if self._stopped:
            return False
        self._moving_begins()
        checked = st.regions.check_remote_one(op, rkey, addr, length, self)
        aborted = False
        try:
            if not checked.first_bad:
                self._moving_ends()  # nothing pinned: no abort can come for it
                self._refused(st, op, (rkey, _r, addr, length), checked.vendor)
                if op == _READ:
                    head = RESPONSE.pack(op, _REM_ACCESS_ERR, int(checked.vendor), seq, 0, 0, 0)
                    send_buffers(sock, [head], RESPONSE.size)
                else:
                    _send_small(sock, RESPONSE.pack(op, _REM_ACCESS_ERR, int(checked.vendor), seq, 0, 0, 0))
                self._refuse_rest(sock, scratch)
                return False
            region = checked.found[0]
            assert region is not None
            view = region.view[addr - region.addr : addr - region.addr + length]
            if op == _WRITE:
                self.deadline.extend(length)
                try:
                    recv_exact(sock, view, self.deadline)
                except PeerGone:
                    if not self.deadline.aborted:
                        raise
                    aborted = True
                if self._moving_ends():
                    aborted = True
                if not aborted:
                    _send_small(sock, RESPONSE.pack(op, 0, 0, seq, 1, 0, 0))
            else:
                send_buffers(sock, [RESPONSE.pack(op, 0, 0, seq, 1, 0, length), view], RESPONSE.size + length)
                if self._moving_ends():
                    return False  # sent whole, but the socket is shut: service ends
        finally:
            self._moving_ends()
            checked.unpin()
        if aborted:
            self._answer_abort(st, seq)
            return False
        return True

    def _write_hooked(self, st: PairState, hooks: Hooks, fd: int, seq: int, d: np.ndarray, scratch: memoryview) -> bool:
        """A WRITE chunk on a hooked pair: ``on_request`` before each request, one response each."""
        sock = self.sock
        for i in range(len(d)):
            rkey, _r, addr, length = (int(x) for x in d[i].tolist())
            if hooks.on_request(st.qp_num, _WRITE, rkey, addr, length) is Fault.DROP or self._stopped:
                return False
            one = d[i : i + 1]
            self._moving_begins()
            checked = st.regions.check_remote(_WRITE, one["rkey"], one["addr"], one["length"], self)
            here = (seq + i) & SEQ_MASK
            try:
                if checked.first_bad == 0:
                    self._moving_ends()  # nothing pinned: no abort can come for it
                    self._refused(st, _WRITE, one[0], checked.vendor)
                    _send_small(sock, RESPONSE.pack(_WRITE, _REM_ACCESS_ERR, int(checked.vendor), here, 0, 0, 0))
                    self._refuse_rest(sock, scratch)
                    return False
                received = self._receive(fd, one, 1)
                aborted = self._moving_ends() or not received
            finally:
                self._moving_ends()
                checked.unpin()
            if aborted:
                self._answer_abort(st, here)
                return False
            _send_small(sock, RESPONSE.pack(_WRITE, 0, 0, here, 1, 0, 0))
        return True

    def _read_first(self, sock: socket.socket, view: memoryview) -> bool:
        """Wait for the next chunk (its header and first descriptor); False when the connection ended."""
        while True:
            try:
                n = sock.recv_into(view, 0, _WAITALL)
            except BlockingIOError:
                # Silence between chunks is an idle pair, not a dead one: keep waiting.
                if self._stopped:
                    return False
                continue
            except OSError:
                return False
            if not n:
                return False
            # The chunk's first bytes are in: the whole chunk is due within one deadline from now.
            self.deadline.start(self.timeout)
            if n < len(view):
                recv_exact(sock, view[n:], self.deadline)  # silence inside a header is a dead peer (PeerGone)
            return True

    def _receive(self, fd: int, d: np.ndarray, n: int) -> bool:
        """Receive the payloads of the first ``n`` WRITEs of a chunk into their (pinned) target ranges;
        False when a deregistration aborted it (the caller unpins, then answers)."""
        iov = iovecs(n)
        total = _fill(d, n, iov, 0)
        if not total:
            return True
        self.deadline.extend(total)
        try:
            recv_all(fd, iov, total, 0, self.deadline)
        except PeerGone:
            if self.deadline.aborted:
                return False
            raise
        return True

    def _answer_abort(self, st: PairState, seq: int) -> None:
        """A deregistration aborted the WRITE at ``seq`` (its regions unpinned already): say
        REM_ACCESS_ERR, and end service once the initiator hung up."""
        self.guard.aborted_receive(st.qp_num)
        with contextlib.suppress(PeerGone):
            _send_small(self.sock, RESPONSE.pack(_WRITE, _REM_ACCESS_ERR, int(VendorErr.REMOTE_DEREGISTERED), seq,
                                                 0, 0, 0))  # fmt: skip
            self._linger(self.sock)

    def _linger(self, sock: socket.socket) -> None:
        """After answering an aborted WRITE on a read-shut socket: wait (at most one ``retry_timeout``)
        for the initiator to hang up, taking in what it still sends, so that closing does not reset the
        connection before it read the answer (a reset would beat it as RETRY_EXC_ERR).

        No write shutdown here: Linux resets a connection that gets data after both of its
        directions were shut (FIN_WAIT with the read side shut), and the initiator is likely still
        sending the payloads of the WRITEs behind the aborted one. The answer makes it hang up."""
        scratch = bytearray(1 << 16)
        until = time.monotonic() + self.timeout
        with contextlib.suppress(OSError):
            while time.monotonic() < until and not self._stopped:
                with contextlib.suppress(BlockingIOError):
                    while sock.recv_into(scratch, 0, socket.MSG_DONTWAIT):
                        pass  # a read-shut socket returns what is queued, then 0
                if sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] in _HUNG_UP:
                    return
                time.sleep(0.005)

    def _refused(self, st: PairState, op: int, desc: tuple[int, int, int, int] | np.void, vendor: VendorErr) -> None:
        rkey, _r, addr, length = (int(x) for x in (desc.tolist() if isinstance(desc, np.void) else desc))
        what = "WRITE" if op == _WRITE else "READ"
        detail = f"{what} rkey {rkey:#x} [{addr:#x}, +{length}): {vendor.name}"
        guess = vendor is not VendorErr.REMOTE_DEREGISTERED  # a stale region is the target's doing, not a guess
        self.guard.access_error(st.qp_num, _host(self.sock), detail, guess=guess)

    def _refuse_rest(self, sock: socket.socket, scratch: memoryview) -> None:
        """After an error response: execute nothing more, drain until the initiator hangs up (for at
        most one ``retry_timeout``: a peer that keeps sending does not keep the thread)."""
        try:
            sock.shutdown(socket.SHUT_WR)
            self.deadline.start(self.timeout)
            while sock.recv_into(scratch):
                self.deadline.check()
        except (OSError, PeerGone):
            pass


def _fill(d: np.ndarray, n: int, iov: np.ndarray, row: int) -> int:
    """Point ``iov[row:row + n]`` at the target ranges of the first ``n`` descriptors; their bytes."""
    if n == 1:
        addr, length = int(d["addr"][0]), int(d["length"][0])
        iov[row] = (addr, length)
        return length
    if n:
        iov[row : row + n, 0] = d["addr"][:n]
        iov[row : row + n, 1] = d["length"][:n]
        return int(d["length"][:n].sum())
    return 0


def _host(sock: socket.socket) -> str:
    try:
        return str(sock.getpeername()[0])
    except OSError:
        return "?"


def _send_small(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data, socket.MSG_NOSIGNAL)
    except BlockingIOError:
        raise PeerGone(VendorErr.SEND_TIMEOUT) from None
    except OSError:
        raise PeerGone(VendorErr.PEER_RESET) from None
