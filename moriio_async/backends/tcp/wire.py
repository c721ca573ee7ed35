"""The data-plane wire: fixed-size little-endian headers and the zero-copy socket loops.

One TCP connection carries one queue pair. The active side opens it and says
hello; after that it only sends requests and the passive side only sends
responses, one per request, in request order (RC)::

    hello      (active -> passive, once)   28 bytes  "<4sHH16sI"
        magic b"MRIO", version, flags=0, token (16 random bytes), active qp_num
    hello-ack  (passive -> active, once)   12 bytes  "<4sHHI"
        magic, version, status (HelloStatus), passive qp_num
    request    (active -> passive)         32 bytes  "<BBHIIIQQ"
        opcode (Opcode value), flags (FLAG_ACK), reserved, seq, rkey,
        reserved, remote_addr, length; an RDMA WRITE's ``length`` payload
        bytes follow
    response   (passive -> active)         16 bytes  "<BBHIQ"
        opcode, status (WcStatus value: SUCCESS or REM_ACCESS_ERR), vendor_err,
        seq, length; a successful RDMA READ's ``length`` payload bytes follow

``seq`` is the request's posting number modulo 2**32. Every READ and every
failed request is answered; a successful WRITE only if it carries FLAG_ACK
(the initiator sets it on signaled WRITEs and on the last request of each
batch it sends), so a response also vouches for the unanswered WRITEs
before it, as RC coalesces ACKs. Responses come in request order. After an
error response the passive side executes nothing more on that connection:
it drains until the peer closes.

Payload bytes never pass through a Python ``bytes``: senders hand the region's
memoryviews to ``sendmsg`` and receivers ``recv_into`` the region's memoryview.
Timeouts are kernel socket timeouts (SO_RCVTIMEO/SO_SNDTIMEO) on blocking
sockets, so each call is one system call and "silence for retry_timeout"
surfaces as EAGAIN, without any polling loop.
"""

from __future__ import annotations

import enum
import fcntl
import socket
import struct
import termios
from typing import Final, TypeVar, cast

__all__ = [
    "FLAG_ACK",
    "HELLO",
    "HELLO_ACK",
    "MAGIC",
    "REQUEST",
    "RESPONSE",
    "VERSION",
    "HelloStatus",
    "PeerGone",
    "VendorErr",
    "advance",
    "configure_data_socket",
    "drain",
    "peer_progress",
    "recv_exact",
    "recv_scatter",
    "send_all",
]

MAGIC: Final = b"MRIO"
VERSION: Final = 1

HELLO: Final = struct.Struct("<4sHH16sI")
HELLO_ACK: Final = struct.Struct("<4sHHI")
REQUEST: Final = struct.Struct("<BBHIIIQQ")
RESPONSE: Final = struct.Struct("<BBHIQ")

SEQ_MASK: Final = 0xFFFFFFFF
FLAG_ACK: Final = 0x01
"""Request flag: answer this WRITE even when it succeeds."""

# struct tcp_info (linux/tcp.h): tcpi_bytes_acked, the peer's cumulative acknowledgements.
_TCPI_BYTES_ACKED: Final = struct.Struct("=Q")
_TCPI_BYTES_ACKED_OFFSET: Final = 120

_B = TypeVar("_B", bound=bytes | memoryview)


class HelloStatus(enum.IntEnum):
    OK = 0
    UNKNOWN_TOKEN = 1
    BAD_HELLO = 2


class VendorErr(enum.IntEnum):
    """What ``WorkCompletion.vendor_err`` carries on this backend: which check or event failed.

    0x0x: checks at the target (with REM_ACCESS_ERR); 0x1x: checks at the
    initiator (with LOC_PROT_ERR); 0x2x: the peer vanished (with RETRY_EXC_ERR);
    0x3x: the peer broke the protocol (with BAD_RESP_ERR); 0x40: a fault hook.
    Flushes (WR_FLUSH_ERR) and successes carry 0.
    """

    NONE = 0
    UNKNOWN_RKEY = 0x01
    REMOTE_DEREGISTERED = 0x02
    REMOTE_OUT_OF_BOUNDS = 0x03
    REMOTE_NO_ACCESS = 0x04
    UNKNOWN_LKEY = 0x11
    LOCAL_OUT_OF_BOUNDS = 0x12
    LOCAL_NO_ACCESS = 0x13
    LOCAL_DEREGISTERED = 0x14
    PEER_CLOSED = 0x21
    PEER_RESET = 0x22
    PEER_SILENT = 0x23
    SEND_TIMEOUT = 0x24
    BAD_RESPONSE = 0x31
    HOOK = 0x40


class PeerGone(Exception):
    """The connection ended, broke, or stayed silent past the socket timeout."""

    def __init__(self, vendor: VendorErr) -> None:
        super().__init__(vendor.name)
        self.vendor = vendor


def configure_data_socket(sock: socket.socket, timeout: float) -> None:
    """Blocking socket, no Nagle, and kernel send/receive timeouts of ``timeout`` seconds."""
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sec = int(timeout)
    usec = max(1, int((timeout - sec) * 1_000_000)) if timeout > sec else 0
    tv = struct.pack("@ll", sec, usec)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from the socket (zero copy). Raises PeerGone."""
    try:
        while view:
            # MSG_WAITALL: one system call for the whole payload in the common case;
            # on SO_RCVTIMEO it returns what arrived, and only a call that got
            # nothing for a whole timeout raises EAGAIN ("silence").
            n = sock.recv_into(view, 0, socket.MSG_WAITALL)
            if n == 0:
                raise PeerGone(VendorErr.PEER_CLOSED)
            view = view[n:]
    except BlockingIOError:
        raise PeerGone(VendorErr.PEER_SILENT) from None
    except OSError:
        raise PeerGone(VendorErr.PEER_RESET) from None


def recv_scatter(sock: socket.socket, views: list[memoryview], total: int) -> None:
    """Fill ``views`` in order from the socket with scatter reads (zero copy). Raises PeerGone."""
    if len(views) == 1:
        recv_exact(sock, views[0])
        return
    try:
        while total:
            n = sock.recvmsg_into(views, 0, socket.MSG_WAITALL)[0]
            if n == 0:
                raise PeerGone(VendorErr.PEER_CLOSED)
            total -= n
            if total:
                views = advance(views, n)
    except BlockingIOError:
        raise PeerGone(VendorErr.PEER_SILENT) from None
    except OSError:
        raise PeerGone(VendorErr.PEER_RESET) from None


def send_all(sock: socket.socket, buffers: list[bytes | memoryview], total: int) -> None:
    """Send ``buffers`` back to back with gather writes (zero copy). Raises PeerGone."""
    try:
        while True:
            n = sock.sendmsg(buffers, (), socket.MSG_NOSIGNAL)
            total -= n
            if not total:
                return
            buffers = advance(buffers, n)
    except BlockingIOError:
        raise PeerGone(VendorErr.SEND_TIMEOUT) from None
    except OSError:
        raise PeerGone(VendorErr.PEER_RESET) from None


def peer_progress(sock: socket.socket, last: int | None) -> tuple[int | None, bool]:
    """After a receive timeout: has the peer acknowledged more of our bytes since ``last``?

    Returns the new mark and the verdict. With no earlier mark, bytes still
    queued towards the peer count as progress for one more timeout, so a
    stalled peer is declared within one to two ``retry_timeout``s. Uses
    ``tcpi_bytes_acked`` (Linux TCP_INFO) and SIOCOUTQ; without them, no
    progress is seen. Called only after a timeout, never on the hot path.
    """
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 192)
        if len(info) < _TCPI_BYTES_ACKED.size + _TCPI_BYTES_ACKED_OFFSET:
            return None, False
        acked: int = _TCPI_BYTES_ACKED.unpack_from(info, _TCPI_BYTES_ACKED_OFFSET)[0]
        if last is not None:
            return acked, acked != last
        queued = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
        return acked, queued > 0
    except (OSError, AttributeError):
        return None, False


def drain(sock: socket.socket, nbytes: int, scratch: memoryview) -> None:
    """Read and discard ``nbytes`` (a rejected WRITE's payload) without touching any region."""
    while nbytes:
        chunk = scratch[: min(nbytes, len(scratch))]
        recv_exact(sock, chunk)
        nbytes -= len(chunk)


def advance(buffers: list[_B], n: int) -> list[_B]:
    """``buffers`` without their first ``n`` bytes (slicing views, copying nothing)."""
    i = 0
    while n >= len(buffers[i]):
        n -= len(buffers[i])
        i += 1
    rest = buffers[i:]
    if n:
        rest[0] = cast(_B, memoryview(rest[0])[n:])
    return rest
