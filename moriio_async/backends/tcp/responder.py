"""The passive side: one thread per accepted data connection, playing the target's NIC.

It checks the hello's token against the passive pairs waiting for a dial,
then serves requests in order until the connection ends: a WRITE's payload is
received straight into the target region, a READ's is sent straight from it.
Every request is checked first (rkey, bounds, access, region alive); a
violation touches no target byte (a rejected WRITE's payload is drained into
a scratch buffer), answers REM_ACCESS_ERR, and ends service on the connection,
as a verbs responder's QP enters the error state.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from typing import TYPE_CHECKING

from ...status import Opcode, WcStatus
from .hooks import Fault
from .wire import (
    FLAG_ACK,
    HELLO,
    HELLO_ACK,
    MAGIC,
    REQUEST,
    RESPONSE,
    VERSION,
    HelloStatus,
    PeerGone,
    VendorErr,
    configure_data_socket,
    drain,
    recv_exact,
    send_all,
)

if TYPE_CHECKING:
    from .backend import TcpBackend
    from .qp import TcpQueuePair

__all__ = ["Responder"]

log = logging.getLogger("moriio_async.tcp")

SCRATCH = 1 << 16
_WRITE = int(Opcode.RDMA_WRITE)
_READ = int(Opcode.RDMA_READ)
_REM_ACCESS_ERR = int(WcStatus.REM_ACCESS_ERR)


class Responder:
    """Serves one accepted connection on its own thread."""

    def __init__(self, backend: TcpBackend, sock: socket.socket) -> None:
        self._backend = backend
        self._sock = sock
        self._sock_lock = threading.Lock()  # stop() never races close() onto a reused fd
        self._stopped = False
        self.qp: TcpQueuePair | None = None
        self.thread = threading.Thread(target=self._run, name=f"moriio-tcp-resp-{backend.port}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Wake the thread and end service (from any thread)."""
        with self._sock_lock:
            self._stopped = True
            if self._sock.fileno() >= 0:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)

    def _run(self) -> None:
        try:
            qp = self._handshake()
            if qp is not None:
                self._serve(qp)
        except PeerGone:
            pass
        except BaseException:
            log.exception("tcp responder on port %d failed", self._backend.port)
        finally:
            with self._sock_lock:
                self._sock.close()
            if self.qp is not None:
                self.qp.responder_done()
            self._backend.responder_finished(self)

    def _handshake(self) -> TcpQueuePair | None:
        sock = self._sock
        options = self._backend.options
        sock.settimeout(options.connect_timeout)
        hello = bytearray(HELLO.size)
        view = memoryview(hello)
        try:
            while view:
                n = sock.recv_into(view)
                if not n:
                    return None
                view = view[n:]
            magic, version, _flags, token, _peer_qp = HELLO.unpack(hello)
            if magic != MAGIC or version != VERSION:
                sock.sendall(HELLO_ACK.pack(MAGIC, VERSION, HelloStatus.BAD_HELLO, 0))
                return None
            qp = self._backend.claim(token)
            if qp is None or not qp.attach(self):
                sock.sendall(HELLO_ACK.pack(MAGIC, VERSION, HelloStatus.UNKNOWN_TOKEN, 0))
                return None
            self.qp = qp
            configure_data_socket(sock, options.retry_timeout)
            sock.sendall(HELLO_ACK.pack(MAGIC, VERSION, HelloStatus.OK, qp.qp_num))
        except OSError:
            return None
        return qp

    def _serve(self, qp: TcpQueuePair) -> None:
        sock = self._sock
        check = self._backend.regions.check_remote
        header = bytearray(REQUEST.size)
        header_view = memoryview(header)
        scratch = memoryview(bytearray(SCRATCH))
        unpack = REQUEST.unpack_from
        pack = RESPONSE.pack
        rsize = RESPONSE.size
        while self._read_header(sock, header_view):
            op, flags, _r16, seq, rkey, _r32, addr, length = unpack(header)
            hooks = qp.hooks
            if hooks is not None and (hooks.on_request(qp.qp_num, op, rkey, addr, length) is Fault.DROP):
                return
            if self._stopped:
                return
            if op != _WRITE and op != _READ:
                log.warning("tcp qp %d: unknown opcode %d from the peer; closing", qp.qp_num, op)
                return
            region = check(op, rkey, addr, length)
            if isinstance(region, VendorErr):
                if op == _WRITE:
                    drain(sock, length, scratch)
                send_all(sock, [pack(op, _REM_ACCESS_ERR, region, seq, 0)], rsize)
                self._refuse_rest(sock, scratch)
                return
            offset = addr - region.addr
            try:
                if op == _WRITE:
                    recv_exact(sock, region.view[offset : offset + length])
                else:
                    response = pack(op, 0, 0, seq, length)
                    send_all(sock, [response, region.view[offset : offset + length]], rsize + length)
            finally:
                region.unpin()
            if op == _WRITE and flags & FLAG_ACK:
                send_all(sock, [pack(op, 0, 0, seq, length)], rsize)

    def _read_header(self, sock: socket.socket, view: memoryview) -> bool:
        """Wait for the next request header; False when the connection ended."""
        while True:
            try:
                n = sock.recv_into(view, 0, socket.MSG_WAITALL)
            except BlockingIOError:
                # Silence between requests is an idle pair, not a dead one: keep waiting.
                if self._stopped:
                    return False
                continue
            except OSError:
                return False
            if not n:
                return False
            if n < len(view):
                recv_exact(sock, view[n:])  # silence inside a header is a dead peer (PeerGone)
            return True

    def _refuse_rest(self, sock: socket.socket, scratch: memoryview) -> None:
        """After an error response: execute nothing more, drain until the initiator hangs up."""
        try:
            sock.shutdown(socket.SHUT_WR)
            while sock.recv_into(scratch):
                pass
        except OSError:
            pass
