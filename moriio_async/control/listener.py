"""A TCP listener whose accept loop is its own: every accepted socket becomes streams or is closed.

Why not ``asyncio.start_server``: on asyncio (3.11), a connection accepted
just before ``Server.close()`` is wrapped in a transport only after the close;
the transport's attach to the closed server fails an assertion and the
accepted socket is dropped unclosed (a ResourceWarning, a leaked fd). Here
the listening sockets are watched with ``loop.add_reader`` and accepted in the
callback, so nothing sits in a future between accept and its owner: each
socket is handed to a short task that wraps it in streams (no server to
attach to), and ``close`` waits for those tasks instead of cancelling them.
It is also the one place where accepting can be paused or capped: ``admit``
is asked about every connection before anything is allocated for it, and a
refused one gets one ``error`` frame (reason ``busy``) and is closed at once.
``has_room`` is asked too, with whether the client's whole first frame
had arrived when it was accepted (its length peeked and the bytes queued
counted, nothing read): an honest dialer sends its hello in one write as
soon as it connects, so when it is accepted from a queue under a flood it
is "talking"; a silent crowd is not, nor one that trickles a byte at a
time. The owner may make room for it (close a connection still in its
hello) or refuse it. The flag is kept for the owner (``talking``), never
waited for: the accept loop never blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import ipaddress
import logging
import socket
import struct
import termios
from collections import Counter
from collections.abc import Callable

from ..core.framing import HEADER
from ..core.protocol import Refused, encode

__all__ = ["Admit", "HasRoom", "Listener"]

log = logging.getLogger("moriio_async")

OnConnection = Callable[[asyncio.StreamReader, asyncio.StreamWriter], None]
Admit = Callable[[str, int, int], str | None]
"""``admit(host, pending from host, pending in all)``: None to accept, else why not (sent to the client).

The pending counts are connections accepted and not yet handed to ``on_connection``."""

_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_RETRY_AFTER = 1.0
"""Seconds without accepting after the process ran out of fds (as asyncio's own accept loop does)."""
_ROOM_BURST = 16
"""Connections accepted per wakeup when the owner makes room (``has_room``)."""
HasRoom = Callable[[int, bool], str | None]
"""``has_room(pending in all, talking)``: None if one more connection in its hello may be accepted now (the
owner may make room for it), else why not. ``talking``: its whole first frame had arrived at accept."""


class Listener:
    """Listens on ``host:port`` and hands every connection, as streams, to ``on_connection``."""

    def __init__(
        self,
        on_connection: OnConnection,
        *,
        admit: Admit | None = None,
        has_room: HasRoom | None = None,
        backlog: int = 128,
    ) -> None:
        self._on_connection = on_connection
        self._admit = admit
        self._has_room = has_room
        self._talking: set[str] = set()
        """Addresses (host:port) of pending connections that were talking at accept."""
        self._pending: Counter[str] = Counter()
        self._backlog = backlog
        self._sockets: list[socket.socket] = []
        self._wrapping: set[asyncio.Task[None]] = set()
        self._retry: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.closed = False

    async def start(self, host: str, port: int) -> int:
        """Bind and listen (every address ``host`` resolves to, on one port); the port. Once only."""
        if self._loop is not None:
            raise RuntimeError("this listener was already started")
        loop = self._loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        try:
            for family, kind, proto, _, address in dict.fromkeys(infos):
                sock = socket.socket(family, kind, proto)
                self._sockets.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                if port == 0 and len(self._sockets) > 1:  # the other families take the port the first got
                    address = (address[0], self.port, *address[2:])
                sock.bind(address)
                sock.listen(self._backlog)
                sock.setblocking(False)
        except OSError as exc:
            self._close_sockets()
            raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc
        self._watch()
        return self.port

    @property
    def port(self) -> int:
        return int(self._sockets[0].getsockname()[1]) if self._sockets else 0

    @property
    def loopback_only(self) -> bool:
        """Every listening address is a loopback one (nothing beyond this host can connect)."""
        hosts = [str(sock.getsockname()[0]).split("%")[0] for sock in self._sockets]
        return bool(hosts) and all(ipaddress.ip_address(h).is_loopback for h in hosts)

    def _watch(self) -> None:
        assert self._loop is not None
        self._retry = None
        if self.closed:
            return
        for sock in self._sockets:
            self._loop.add_reader(sock.fileno(), self._accept, sock)

    def _unwatch(self) -> None:
        assert self._loop is not None
        for sock in self._sockets:
            self._loop.remove_reader(sock.fileno())

    def _accept(self, sock: socket.socket) -> None:
        assert self._loop is not None
        if self._retry is not None or self.closed:  # paused by another listening socket's callback just now
            return
        # With an owner that makes room (closes connections still in their hello for new ones), a wakeup
        # takes a few only: between wakeups the hellos already accepted are read, so a flood of newcomers
        # cannot push out an honest connection before its hello, already sent, is even looked at.
        for _ in range(_ROOM_BURST if self._has_room is not None else self._backlog):
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                if exc.errno not in _OUT_OF_RESOURCES:
                    log.warning("control listener: accept failed: %s", exc)
                    return
                log.warning("control listener: %s; not accepting for %gs", exc, _RETRY_AFTER)
                self._unwatch()
                self._retry = self._loop.call_later(_RETRY_AFTER, self._watch)
                return
            conn.setblocking(False)
            try:
                host = str(conn.getpeername()[0])
            except OSError:  # the client left at once
                conn.close()
                continue
            talking = _talking(conn)
            try:
                refusal = self._admit(host, self._pending[host], self._pending.total()) if self._admit else None
                if refusal is None and self._has_room is not None:
                    refusal = self._has_room(self._pending.total(), talking)
            except Exception:  # the owner's bug: this connection is closed, the next ones are still asked
                conn.close()
                log.exception("control listener: admit failed for a connection from %s; closed it", host)
                continue
            if refusal is not None:
                _refuse(conn, refusal)
                continue
            self._pending[host] += 1
            if talking:
                self._talking.add(_address(conn))
            task = self._loop.create_task(self._wrap(conn, host))
            self._wrapping.add(task)
            task.add_done_callback(self._wrapping.discard)

    def talking(self, address: str) -> bool:
        """The connection from ``address`` (host:port) being handed over was talking at accept."""
        return address in self._talking

    async def _wrap(self, conn: socket.socket, host: str) -> None:
        address = _address(conn)
        try:
            reader, writer = await asyncio.open_connection(sock=conn)
        except OSError as exc:  # the client left at once
            conn.close()
            self._talking.discard(address)
            log.debug("control listener: an accepted connection failed: %s", exc)
            return
        except BaseException:
            conn.close()
            self._talking.discard(address)
            raise
        finally:
            self._pending[host] -= 1
            if self._pending[host] <= 0:
                del self._pending[host]
        try:
            if self.closed:
                writer.close()  # accepted while the listener closed: the connection is refused, not leaked
                return
            self._on_connection(reader, writer)
        finally:
            self._talking.discard(address)

    async def close(self) -> None:
        """Stop accepting, close the listening sockets, and settle every connection accepted so far."""
        if self.closed:
            return
        self.closed = True
        if self._loop is not None and self._sockets:
            if self._retry is not None:
                self._retry.cancel()
            else:
                self._unwatch()
        self._close_sockets()
        # Not cancelled: a task cancelled before its first step would never close its socket.
        if self._wrapping:
            await asyncio.wait(list(self._wrapping))

    def _close_sockets(self) -> None:
        for sock in self._sockets:
            sock.close()
        self._sockets.clear()


def _talking(conn: socket.socket) -> bool:
    """The client's whole first frame had arrived by the time it was accepted (never reads, never waits).

    Some bytes are not enough: a crowd that trickles a byte now and then would look like honest dialers,
    and the one in its hello that is closed to make room is chosen among those that are not talking first.
    Nor is an empty frame (four zero bytes, which a trickle of zeros makes): no message is empty.
    """
    try:
        head = conn.recv(HEADER.size, socket.MSG_PEEK)
        if len(head) < HEADER.size:
            return False
        (length,) = HEADER.unpack(head)
        queued = struct.unpack("i", fcntl.ioctl(conn.fileno(), termios.FIONREAD, bytes(4)))[0]
    except OSError:  # BlockingIOError: nothing yet
        return False
    return bool(length and queued >= HEADER.size + length)


def _address(conn: socket.socket) -> str:
    try:
        peer = conn.getpeername()
    except OSError:
        return "?"
    return f"{peer[0]}:{peer[1]}"


def _refuse(conn: socket.socket, why: str) -> None:
    """Tell a refused client why (best effort: one small frame into an empty send buffer) and close.

    What the client already sent is read first: closing a socket with unread data
    sends a reset, which may destroy the explanation before the client reads it.
    """
    with contextlib.suppress(OSError):
        conn.recv(1 << 16)
    with contextlib.suppress(OSError):
        conn.send(encode(Refused(reason="busy", message=why)))
    conn.close()
