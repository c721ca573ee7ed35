"""The data-plane wire (version 2): the handshake, chunks of requests and their responses.

One TCP connection carries one queue pair. The active side opens it and says
hello; after that it only sends chunks and the passive side only sends
responses, in order (RC)::

    hello      (active -> passive, once)   28 bytes  "<4sHH16sI"
        magic b"MRIO", version, flags=0, token (16 bytes, single-use: derived from the
        control link's session key with a shared secret, else random; see qp.py), active qp_num
    hello-ack  (passive -> active, once)   12 bytes  "<4sHHI"
        magic, version, status (HelloStatus), passive qp_num
    chunk      (active -> passive)         16 bytes  "<BBHIII", then count x 24-byte descriptors
        opcode (one for the whole chunk), flags=0, reserved, seq of its first
        request, count (1..MAX_CHUNK), reserved; descriptor "<IIQQ": rkey,
        reserved, remote_addr, length; a WRITE chunk's payloads follow, back to back
    response   (passive -> active)         24 bytes  "<BBHIIIQ"
        opcode, status (SUCCESS or REM_ACCESS_ERR), vendor_err, seq (the first
        request it covers), done (how many succeeded from seq on), reserved,
        payload (bytes that follow it: a READ chunk's payloads of the done requests)

``seq`` is a request's posting number modulo 2**32. A chunk is consecutive
requests of one opcode, framed in one pass (a numpy structured array filled
column-wise), so a batch of thousands of blocks costs a few array operations
and one ``sendmsg`` per up to ``IOV_MAX`` blocks. Every chunk is answered by
one response covering all of it (RC's coalesced ACK), except that a target
with fault hooks answers a WRITE chunk one request at a time. A response with
a non-zero status means request ``seq + done`` failed and nothing after it
ran: the passive side then executes nothing more on the connection and drains
until the peer closes.

Payload bytes never pass through a Python ``bytes``: both sides move them with
``sendmsg``/``recvmsg`` on iovec arrays that point into the registered
buffers (``iov.py``). Timeouts are kernel socket timeouts
(SO_RCVTIMEO/SO_SNDTIMEO) on blocking sockets, so each call is one system
call and "silence for retry_timeout" surfaces as EAGAIN, without polling.
"""

from __future__ import annotations

import enum
import fcntl
import socket
import struct
import termios
from typing import Final

import numpy as np

__all__ = [
    "CHUNK",
    "DESC",
    "HELLO",
    "HELLO_ACK",
    "MAGIC",
    "MAX_CHUNK",
    "RESPONSE",
    "SEQ_MASK",
    "VERSION",
    "HelloStatus",
    "PeerGone",
    "VendorErr",
    "configure_data_socket",
    "peer_progress",
]

HELLO: Final = struct.Struct("<4sHH16sI")
HELLO_ACK: Final = struct.Struct("<4sHHI")
CHUNK: Final = struct.Struct("<BBHIII")
DESC: Final = np.dtype([("rkey", "<u4"), ("reserved", "<u4"), ("addr", "<u8"), ("length", "<u8")])
RESPONSE: Final = struct.Struct("<BBHIIIQ")

MAGIC: Final = b"MRIO"
"""The first bytes of a hello and of its ack: a data port, not some other service."""
VERSION: Final = 2

MAX_CHUNK: Final = 1024
"""Requests per chunk: bounds what a peer makes the target allocate (24 KiB of descriptors)."""
SEQ_MASK: Final = 0xFFFFFFFF

# struct tcp_info (linux/tcp.h): tcpi_bytes_acked, the peer's cumulative acknowledgements.
_TCPI_BYTES_ACKED: Final = struct.Struct("=Q")
_TCPI_BYTES_ACKED_OFFSET: Final = 120


class HelloStatus(enum.IntEnum):
    OK = 0
    UNKNOWN_TOKEN = 1
    BAD_HELLO = 2
    BAD_VERSION = 3


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
