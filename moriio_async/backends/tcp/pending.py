"""Bytes still to move on a non-blocking socket, resumed at each readiness: straight into or out of their buffers.

A responder's receive of a WRITE chunk's payloads and its send of a READ
chunk's response go through one of these: either socket-module buffers (a
header, one request's view of its target range) or an iovec list
(``iov.py``: many blocks, one ``recvmsg``/``sendmsg`` per up to IOV_MAX). A
call moves what the kernel has or takes now and says whether the rest is
still due; nothing is copied through Python objects, and nothing waits.
"""

from __future__ import annotations

import socket
from typing import Final

from .iov import Iov, advance, advance_buffers, recvmsg, sendmsg

__all__ = ["Pending"]

_NOSIGNAL: Final = int(socket.MSG_NOSIGNAL)


class Pending:
    """``left`` bytes to move through ``buffers`` (socket-module calls) or ``iov`` from row ``start``;
    ``keep`` holds what the iovecs point into besides pinned regions (a response header)."""

    __slots__ = ("buffers", "iov", "keep", "left", "start")

    def __init__(
        self, left: int, buffers: list[bytes | memoryview] | None = None, iov: Iov | None = None, keep: object = None
    ) -> None:
        self.left = left
        self.buffers = buffers
        self.iov = iov
        self.start = 0
        self.keep = keep

    def send(self, sock: socket.socket, calls: int = 1 << 30) -> bool:
        """Send what the socket takes now (in at most ``calls`` calls); True once all is out. Raises
        OSError (the peer is gone)."""
        for _ in range(calls):
            if self.left <= 0:
                break
            try:
                if self.iov is not None:
                    n = sendmsg(sock.fileno(), self.iov, self.start)
                else:
                    assert self.buffers is not None
                    n = sock.sendmsg(self.buffers, (), _NOSIGNAL)
            except BlockingIOError:
                return False
            self._moved(n)
        return self.left <= 0

    def recv(self, sock: socket.socket, calls: int = 1 << 30) -> bool:
        """Receive what has come (in at most ``calls`` calls); True once all is in. Raises EOFError at
        the end of the stream and OSError (the peer is gone)."""
        for _ in range(calls):
            if self.left <= 0:
                break
            try:
                if self.iov is not None:
                    n = recvmsg(sock.fileno(), self.iov, self.start, 0)
                else:
                    assert self.buffers is not None
                    n = sock.recv_into(self.buffers[0])
            except BlockingIOError:
                return False
            if not n:
                raise EOFError
            self._moved(n)
        return self.left <= 0

    def _moved(self, n: int) -> None:
        self.left -= n
        if self.left <= 0:
            return
        if self.iov is not None:
            self.start = advance(self.iov, self.start, n)
        else:
            assert self.buffers is not None
            self.buffers = advance_buffers(self.buffers, n)
