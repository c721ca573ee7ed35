"""The queue pair's Unix-domain connection: fixed-size messages on a SOCK_SEQPACKET socket.

One connection per queue pair, from the initiator (active side, the one that
posts) to the target (passive side, whose memory it reads and writes). Bytes
never travel on it: the initiator moves them itself, with
``process_vm_readv``/``writev`` or a copy through a shared mapping. The
connection carries only what makes that safe::

    hello    initiator -> target  40 bytes  magic, HELLO, version, token (16), initiator qp_num, pid
    welcome  target -> initiator  72 bytes  magic, WELCOME, status, version, target qp_num, pid,
                                            start time, boot id (16), probe address, probe nonce (16),
                                            table slots; with the region table's memfd (SCM_RIGHTS)
    ready    initiator -> target  24 bytes  status 0, or the errno of the probe read (then it closes)
    established target -> initiator 24 bytes  the target holds the in-use page: ``connect`` returns
    revoke   target -> initiator  24 bytes  a = serial, b = rkey: a region was deregistered
    ack      initiator -> target  24 bytes  a = serial: nothing of that region moves any more
    need     initiator -> target  24 bytes  a = allocation id: pass me its memfd
    fd       target -> initiator  24 bytes  status, a = allocation id, c = size; with the memfd

Every receive reads at most ``MAX_MESSAGE`` bytes and one descriptor's worth of
ancillary data; a message of the wrong size or type, or a truncated one, is a
protocol error and ends the connection. Descriptors that arrive where none is
expected are closed at once. The kernel tells each end who the other is
(``SO_PEERCRED``: pid, uid), which is checked before anything else.
"""

from __future__ import annotations

import array
import contextlib
import enum
import os
import socket
import struct
from typing import Final

__all__ = [
    "HELLO",
    "MAGIC",
    "MAX_MESSAGE",
    "MSG",
    "VERSION",
    "WELCOME",
    "Kind",
    "PeerCred",
    "ProtocolError",
    "Status",
    "VendorErr",
    "peer_cred",
    "receive",
    "send",
]

MAGIC: Final = b"MCMA"
VERSION: Final = 2
"""2: the region table and read-only allocations are sealed against peers' writes (``table.py``)."""
HELLO: Final = struct.Struct("<4sBBH16sIIQ")
WELCOME: Final = struct.Struct("<4sBBHIIQ16sQ16sII")
MSG: Final = struct.Struct("<4sBBHIIQ")
MAX_MESSAGE: Final = 128
_FD_SPACE: Final = socket.CMSG_SPACE(array.array("i").itemsize)


class Kind(enum.IntEnum):
    HELLO = 1
    WELCOME = 2
    READY = 3
    REVOKE = 4
    ACK = 5
    NEED = 6
    FD = 7
    ESTABLISHED = 8


class Status(enum.IntEnum):
    OK = 0
    UNKNOWN_TOKEN = 1
    BAD_VERSION = 2
    WRONG_USER = 3
    NO_SUCH_ALLOCATION = 4
    TABLE_FULL = 5


class VendorErr(enum.IntEnum):
    """What ``WorkCompletion.vendor_err`` carries on this backend: which check or event failed.

    0x0x: the target's regions (with REM_ACCESS_ERR); 0x1x: local checks (with
    LOC_PROT_ERR); 0x2x: the target vanished (with RETRY_EXC_ERR); 0x3x: the
    target broke the protocol or the kernel refused (with BAD_RESP_ERR / REM_OP_ERR).
    """

    NONE = 0
    UNKNOWN_RKEY = 0x01
    REMOTE_REVOKED = 0x02
    REMOTE_OUT_OF_BOUNDS = 0x03
    REMOTE_NO_ACCESS = 0x04
    REMOTE_FAULT = 0x05
    UNKNOWN_LKEY = 0x11
    LOCAL_OUT_OF_BOUNDS = 0x12
    LOCAL_NO_ACCESS = 0x13
    LOCAL_FAULT = 0x14
    PEER_EXITED = 0x21
    PEER_CLOSED = 0x22
    PID_REUSED = 0x23
    BAD_MESSAGE = 0x31
    NOT_PERMITTED = 0x32
    NO_MAPPING = 0x33


class ProtocolError(Exception):
    """The other end sent something this protocol does not allow, or closed."""


class PeerCred:
    """What the kernel says about the other end of a Unix socket."""

    __slots__ = ("gid", "pid", "uid")

    def __init__(self, pid: int, uid: int, gid: int) -> None:
        self.pid, self.uid, self.gid = pid, uid, gid


def peer_cred(sock: socket.socket) -> PeerCred:
    """``SO_PEERCRED``: the pid (in this pid namespace; 0 when not visible here), uid and gid."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerCred(pid, uid, gid)


def send(sock: socket.socket, data: bytes, fd: int | None = None, *, block: bool = True) -> None:
    """Send one message (with ``fd`` attached). ``block=False`` raises BlockingIOError rather than wait."""
    flags = socket.MSG_NOSIGNAL | (0 if block else socket.MSG_DONTWAIT)
    anc = [] if fd is None else [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())]
    sock.sendmsg([data], anc, flags)


def receive(sock: socket.socket, want_fd: bool = False) -> tuple[bytes, int | None]:
    """One message and, with ``want_fd``, the descriptor attached to it (closed otherwise).

    Raises ProtocolError on end of stream or a truncated message; OSError from the socket.
    """
    data, anc, flags, _addr = sock.recvmsg(MAX_MESSAGE, _FD_SPACE)
    fds: list[int] = []
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(payload) - len(payload) % array.array("i").itemsize
            fds.extend(array.array("i", payload[:usable]))
    fd = fds.pop(0) if want_fd and fds else None
    for extra in fds:
        with contextlib.suppress(OSError):
            os.close(extra)
    if not data:
        if fd is not None:
            os.close(fd)
        raise ProtocolError("the other end closed the connection")
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        if fd is not None:
            os.close(fd)
        raise ProtocolError("a message longer than the protocol allows")
    if data[:4] != MAGIC:
        if fd is not None:
            os.close(fd)
        raise ProtocolError("not a moriio cma message")
    return data, fd
