"""Vectored socket I/O over iovec arrays: one system call moves many blocks, no Python object per block.

Python's ``socket.sendmsg``/``recvmsg_into`` take one buffer object per block,
so a batch of a thousand 4 KiB blocks would cost a thousand memoryview slices
on each side. Here a gather/scatter list is a numpy array (``IOVEC``: base
address, length), filled column-wise from a batch's address and length
arrays, and ``sendmsg(2)``/``recvmsg(2)`` are called through ctypes, which
releases the GIL for the call, as the socket module does.

The addresses must stay valid for the call: callers check every block
against the region table and pin its region first (``regions.py``), and hold
the numpy arrays (chunk headers, iovec arrays) they point at.

A receive may carry a ``Deadline``: the whole message (a hello, a chunk's
descriptors, its payloads) must arrive by then, however the peer spaces its
bytes. The kernel's receive timeout alone is per call, so a peer sending a
byte now and then would keep one call after another alive; the deadline is
checked only when a call returns short (never on the usual one-call path),
and it tightens the kernel timeout so that no call outlives it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import struct
import time
from collections.abc import Callable
from typing import Final, TypeVar, cast

import numpy as np
import numpy.typing as npt

from .wire import PeerGone, VendorErr

__all__ = [
    "IOV_MAX",
    "MIN_RATE",
    "Deadline",
    "HeldIo",
    "Iov",
    "address",
    "advance",
    "advance_buffers",
    "iovecs",
    "prefix",
    "recv_all",
    "recv_buffers",
    "recv_exact",
    "recvmsg",
    "send_all",
    "send_buffers",
    "sendmsg",
]

IOV_MAX: Final = 1024
"""Entries one call takes (Linux UIO_MAXIOV); longer lists take several calls."""
_ROW: Final = 16  # sizeof(struct iovec) on 64-bit Linux: base, length

_B = TypeVar("_B", bound=bytes | memoryview)
_At = TypeVar("_At")  # where the next call starts: a row of an Iov, or the buffers left

MIN_RATE: Final = 1 << 20
"""Bytes per second a peer must at least keep up within one message (beyond its first timeout)."""


def set_receive_timeout(sock: socket.socket, seconds: float) -> None:
    """SO_RCVTIMEO of ``seconds`` (at least a microsecond)."""
    sec = int(seconds)
    usec = max(1, int((seconds - sec) * 1_000_000)) if seconds > sec or not sec else 0
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("@ll", sec, usec))


class Deadline:
    """One message's total deadline on one socket, and the abort switch of whoever receives it.

    ``start(seconds)`` when a message's first bytes arrived, ``extend(nbytes)``
    for its payloads (``nbytes / MIN_RATE`` more), ``end()`` once it is in.
    ``check()`` runs after a short receive: it raises ``PeerGone`` once the
    deadline passed or ``aborted`` was set, and otherwise lowers the socket's
    receive timeout to what is left (``end`` restores it).
    """

    @classmethod
    def after(cls, sock: socket.socket, timeout: float, nbytes: int) -> Deadline:
        """A deadline starting now for a message with ``nbytes`` still to come."""
        deadline = cls(sock, timeout)
        deadline.start(timeout)
        deadline.extend(nbytes)
        return deadline

    __slots__ = ("aborted", "at", "sock", "tightened", "timeout")

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self.sock = sock
        self.timeout = timeout
        self.at = float("inf")
        self.tightened = False
        self.aborted = False

    def start(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def extend(self, nbytes: int) -> None:
        self.at += nbytes / MIN_RATE

    def check(self) -> None:
        if self.aborted:
            raise PeerGone(VendorErr.PEER_CLOSED)
        left = self.at - time.monotonic()
        if left <= 0:
            raise PeerGone(VendorErr.PEER_SILENT)
        if left < self.timeout:
            try:
                set_receive_timeout(self.sock, left)
            except OSError:
                raise PeerGone(VendorErr.PEER_RESET) from None
            self.tightened = True

    def end(self) -> None:
        self.at = float("inf")
        if self.tightened:
            self.tightened = False
            try:
                set_receive_timeout(self.sock, self.timeout)
            except OSError:
                raise PeerGone(VendorErr.PEER_RESET) from None


Iov = npt.NDArray[np.uint64]
"""An iovec list: ``n`` rows of (base address, length), laid out as ``struct iovec[n]``."""


class _MsgHdr(ctypes.Structure):
    _fields_ = [
        ("msg_name", ctypes.c_void_p),
        ("msg_namelen", ctypes.c_uint32),
        ("msg_iov", ctypes.c_void_p),
        ("msg_iovlen", ctypes.c_size_t),
        ("msg_control", ctypes.c_void_p),
        ("msg_controllen", ctypes.c_size_t),
        ("msg_flags", ctypes.c_int),
    ]


_libc = ctypes.CDLL(None, use_errno=True)
_sendmsg = _libc.sendmsg
_sendmsg.argtypes = [ctypes.c_int, ctypes.POINTER(_MsgHdr), ctypes.c_int]
_sendmsg.restype = ctypes.c_ssize_t
_recvmsg = _libc.recvmsg
_recvmsg.argtypes = [ctypes.c_int, ctypes.POINTER(_MsgHdr), ctypes.c_int]
_recvmsg.restype = ctypes.c_ssize_t
_NOSIGNAL: Final = int(socket.MSG_NOSIGNAL)  # plain ints: IntFlag arithmetic costs a call per request
_WAITALL: Final = int(socket.MSG_WAITALL)
_DONTWAIT: Final = int(socket.MSG_DONTWAIT)

# The same calls through PyDLL, which keeps the GIL: only ever with MSG_DONTWAIT (they cannot
# block). Releasing the GIL for a call that returns at once hands it to another thread of the
# process (the receiver, the event loop), and getting it back costs a wakeup and a wait for that
# thread's next blocking call: on a busy pair, far more than the call itself.
_held = ctypes.PyDLL(None, use_errno=True)
_send_held = _held.send
_send_held.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
_send_held.restype = ctypes.c_ssize_t
_sendmsg_held = _held.sendmsg
_sendmsg_held.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
_sendmsg_held.restype = ctypes.c_ssize_t
_recvmsg_held = _held.recvmsg
_recvmsg_held.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
_recvmsg_held.restype = ctypes.c_ssize_t
_MSGHDR = struct.Struct("@PIPNPNi")  # struct msghdr (ctypes.sizeof(_MsgHdr) with its tail padding)
_IOVEC = struct.Struct("@PN")


class HeldIo:
    """Non-blocking socket calls that keep the GIL, for a few blocks, from one thread at a time.

    Each call's ``struct msghdr`` and iovecs are packed into this object's own
    buffer (the kernel copies them in; nothing outlives the call), and a header
    in ``bytes`` is copied beside them, so a call makes no Python object. A
    call returns what moved, or -1 when nothing could (a full or empty socket
    buffer, or a signal): the caller's blocking path, which releases the GIL,
    takes over from there. MSG_DONTWAIT does not keep a call from sleeping for
    the socket's own lock, which another thread's blocking call may hold for a
    millisecond: callers use one only when none can be (``pairstate.py``).
    """

    MAX_BLOCKS: Final = 8
    _HEAD: Final = 256

    def __init__(self) -> None:
        size = ctypes.sizeof(_MsgHdr) + _IOVEC.size * (self.MAX_BLOCKS + 1) + self._HEAD
        self._buf = (ctypes.c_char * size)()
        self._view = memoryview(self._buf).cast("B")
        self._base = ctypes.addressof(self._buf)
        self._iov = ctypes.sizeof(_MsgHdr)
        self._head = self._iov + _IOVEC.size * (self.MAX_BLOCKS + 1)

    def send(self, fd: int, head: bytes, blocks: list[tuple[int, int]]) -> int:
        """``head`` (at most 256 bytes) then ``blocks`` ((address, length), at most MAX_BLOCKS,
        checked and pinned by the caller). Raises OSError."""
        if not blocks:
            return _moved(_send_held(fd, head, len(head), _DONTWAIT | _NOSIGNAL))
        view, n = self._view, len(head)
        view[self._head : self._head + n] = head
        _IOVEC.pack_into(view, self._iov, self._base + self._head, n)
        return self._call(_sendmsg_held, fd, blocks, 1, _DONTWAIT | _NOSIGNAL)

    def recv(self, fd: int, blocks: list[tuple[int, int]]) -> int:
        """Into ``blocks`` ((address, length), at most MAX_BLOCKS + 1, pinned by the caller); 0 at
        the end of the stream. Raises OSError."""
        return self._call(_recvmsg_held, fd, blocks, 0, _DONTWAIT)

    def _call(self, fn: ctypes._NamedFuncPointer, fd: int, blocks: list[tuple[int, int]], row: int,
              flags: int) -> int:  # fmt: skip
        view, at = self._view, self._iov + row * _IOVEC.size
        for base, length in blocks:
            _IOVEC.pack_into(view, at, base, length)
            at += _IOVEC.size
        _MSGHDR.pack_into(view, 0, 0, 0, self._base + self._iov, row + len(blocks), 0, 0, 0)
        return _moved(fn(fd, self._base, flags))


def _moved(n: int) -> int:
    if n >= 0:
        return n
    err = ctypes.get_errno()
    if err in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
        return -1
    raise OSError(err, os.strerror(err))


def address(array: npt.NDArray[np.generic]) -> int:
    """Where a numpy array's data starts."""
    return int(array.ctypes.data)


def iovecs(n: int) -> Iov:
    """An uninitialised iovec list of ``n`` rows."""
    return np.empty((n, 2), dtype=np.uint64)


def _call(fn: ctypes._NamedFuncPointer, fd: int, iov: Iov, start: int, flags: int) -> int:
    count = min(len(iov) - start, IOV_MAX)
    hdr = _MsgHdr(None, 0, address(iov) + start * _ROW, count, None, 0, 0)
    while True:
        n: int = fn(fd, ctypes.byref(hdr), flags)
        if n >= 0:
            return n
        err = ctypes.get_errno()
        if err == errno.EINTR:
            continue  # as the socket module does (PEP 475)
        if err in (errno.EAGAIN, errno.EWOULDBLOCK):
            raise BlockingIOError(err, os.strerror(err))
        raise OSError(err, os.strerror(err))


def sendmsg(fd: int, iov: Iov, start: int = 0, flags: int = 0) -> int:
    """One ``sendmsg(2)`` of ``iov[start:]`` (at most IOV_MAX entries); bytes sent. Raises
    BlockingIOError (EAGAIN: the send timeout, or a full buffer with MSG_DONTWAIT) or OSError."""
    return _call(_sendmsg, fd, iov, start, flags | _NOSIGNAL)


def recvmsg(fd: int, iov: Iov, start: int = 0, flags: int = _WAITALL) -> int:
    """One ``recvmsg(2)`` into ``iov[start:]`` (at most IOV_MAX entries); bytes received, 0 at end
    of stream. Raises BlockingIOError (EAGAIN: nothing for a whole receive timeout) or OSError."""
    return _call(_recvmsg, fd, iov, start, flags)


def advance(iov: Iov, start: int, n: int) -> int:
    """Consume ``n`` bytes from ``iov[start:]`` in place; the index of the first entry left."""
    cum = np.cumsum(iov[start : start + IOV_MAX, 1])
    k = int(np.searchsorted(cum, n, side="right"))
    rest = n - (int(cum[k - 1]) if k else 0)
    start += k
    if rest:
        iov[start, 0] += np.uint64(rest)
        iov[start, 1] -= np.uint64(rest)
    return start


def _send_whole(send: Callable[[_At], int], skip: Callable[[_At, int], _At], at: _At, total: int) -> None:
    """``send(at)`` until ``total`` bytes went, ``skip`` moving ``at`` past what each call took (blocking).
    Raises PeerGone."""
    try:
        while True:
            n = send(at)
            total -= n
            if total <= 0:
                return
            at = skip(at, n)
    except BlockingIOError:
        raise PeerGone(VendorErr.SEND_TIMEOUT) from None
    except OSError:
        raise PeerGone(VendorErr.PEER_RESET) from None


def _recv_whole(
    recv: Callable[[_At], int], skip: Callable[[_At, int], _At], at: _At, total: int, deadline: Deadline | None
) -> None:
    """``recv(at)`` until ``total`` bytes came, ``skip`` moving ``at`` past what each call filled (blocking;
    silence inside is a dead peer, and so is missing ``deadline``, checked only after a short call).
    Raises PeerGone."""
    try:
        while total > 0:
            n = recv(at)
            if n == 0:
                raise PeerGone(VendorErr.PEER_CLOSED)
            total -= n
            if total > 0:
                if deadline is not None:
                    deadline.check()
                at = skip(at, n)
    except BlockingIOError:
        raise PeerGone(VendorErr.PEER_SILENT) from None
    except OSError:
        raise PeerGone(VendorErr.PEER_RESET) from None


def send_all(fd: int, iov: Iov, total: int, start: int = 0) -> None:
    """Send ``total`` bytes from ``iov[start:]`` (blocking). Raises PeerGone."""
    _send_whole(lambda at: sendmsg(fd, iov, at), lambda at, n: advance(iov, at, n), start, total)


def recv_all(fd: int, iov: Iov, total: int, start: int = 0, deadline: Deadline | None = None) -> None:
    """Fill ``iov[start:]`` with ``total`` bytes (blocking; silence inside is a dead peer, and so is
    missing ``deadline``). Raises PeerGone."""
    _recv_whole(lambda at: recvmsg(fd, iov, at), lambda at, n: advance(iov, at, n), start, total, deadline)


def recv_exact(sock: socket.socket, view: memoryview, deadline: Deadline | None = None) -> None:
    """Fill ``view`` (headers, descriptors, one request's payload) from the socket, by ``deadline``
    if given. Raises PeerGone."""
    try:
        while view:
            n = sock.recv_into(view, 0, _WAITALL)
            if n == 0:
                raise PeerGone(VendorErr.PEER_CLOSED)
            view = view[n:]
            if view and deadline is not None:
                deadline.check()
    except BlockingIOError:
        raise PeerGone(VendorErr.PEER_SILENT) from None
    except OSError:
        raise PeerGone(VendorErr.PEER_RESET) from None


def prefix(iov: Iov, start: int, nbytes: int) -> Iov:
    """A copy of the rows of ``iov[start:]`` that hold its first ``nbytes`` bytes (the last one cut)."""
    lengths = iov[start:, 1]
    cum = np.cumsum(lengths)
    k = int(np.searchsorted(cum, nbytes, side="left")) + 1 if nbytes else 0
    out = iov[start : start + k].copy()
    if k:
        out[-1, 1] -= np.uint64(int(cum[k - 1]) - nbytes)
    return out


# -- a few buffers: the socket module's own calls (one request, a response) --------------------


def send_buffers(sock: socket.socket, buffers: list[bytes | memoryview], total: int) -> None:
    """Send ``buffers`` back to back with gather writes (zero copy). Raises PeerGone."""
    _send_whole(lambda left: sock.sendmsg(left, (), _NOSIGNAL), advance_buffers, buffers, total)


def advance_buffers(buffers: list[_B], n: int) -> list[_B]:
    """``buffers`` without their first ``n`` bytes (slicing views, copying nothing)."""
    i = 0
    while n >= len(buffers[i]):
        n -= len(buffers[i])
        i += 1
    rest = buffers[i:]
    if n:
        rest[0] = cast(_B, memoryview(rest[0])[n:])
    return rest


def recv_buffers(sock: socket.socket, views: list[memoryview], total: int, deadline: Deadline | None = None) -> None:
    """Fill ``views`` in order with ``total`` bytes (silence inside is a dead peer, and so is missing
    ``deadline``). Raises PeerGone."""
    _recv_whole(lambda left: sock.recvmsg_into(left, 0, _WAITALL)[0], advance_buffers, views, total, deadline)
