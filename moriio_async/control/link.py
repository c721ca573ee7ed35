"""Control-plane links: typed requests, replies and notices (``core.protocol``) over asyncio streams.

One link per connection, in either direction, with one reader task for the
link's life. What a frame holds decides how it is handled:

- a reply resolves the request waiting for it;
- a notice is handed to ``LinkHandler.on_notice`` by the reader itself, before
  it reads the next frame: notices are handled in arrival order by
  construction, and a notice sent after a request is handled after that
  request has started;
- a request runs as a task of its own (its handler may wait, e.g. on a queue
  pair's connect), and its reply goes back with the request's id.

Every message has one total deadline from its first byte to its last (a
peer that trickles a byte at a time gains nothing), and during the hello the
wait for the first byte has it too. A malformed or oversized frame gets one
error reply and the link is closed, which the listener survives; the handler
hears of it (``on_bad_frame``) to log it, rate-limited.

What a peer can make a link hold is bounded: at most ``max_pending``
requests run at once (the reader stops reading until one ends, so TCP pushes
back on the sender), and a notice is awaited before the next frame is read,
so a handler that has no room (a full notification inbox) pushes back too.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from typing import Protocol, TypeVar

from ..core.framing import HEADER, FrameError, parse_header
from ..core.protocol import (
    Challenge,
    CloseQp,
    ConnectQp,
    Done,
    Exports,
    Hello,
    ListMemory,
    Message,
    Notice,
    Notify,
    Proof,
    QpReady,
    Refused,
    Reply,
    Request,
    Welcome,
    answering,
    decode,
    encode,
    with_id,
)
from ..errors import AuthenticationError, ControlPlaneError, EngineClosed, MoriioError, PeerError, StalePeer

__all__ = ["ControlLink", "LinkHandler"]

log = logging.getLogger("moriio_async")

R = TypeVar("R", Challenge, Welcome, QpReady, Exports)
_REASONS: dict[type[MoriioError], str] = {StalePeer: "stale", EngineClosed: "closed", AuthenticationError: "auth"}
DEFAULT_MAX_PENDING = 32
"""Requests of one peer served at once on one link; the reader waits for one to end before reading more."""


class LinkHandler(Protocol):
    """What a link hands its peer's frames to (the engine's peer table)."""

    async def on_request(self, link: ControlLink, request: Request) -> Reply:
        """The reply to send. Raising a ``MoriioError`` sends a ``Refused`` instead (``StalePeer``: "stale",
        ``EngineClosed``: "closed", ``AuthenticationError``: "auth", others: "refused"); anything else is
        logged as a bug ("internal")."""
        ...

    async def on_notice(self, link: ControlLink, notice: Notice) -> None:
        """Awaited by the reader before it reads the next frame (arrival order; waiting here pushes back)."""
        ...

    def on_bad_frame(self, link: ControlLink, error: FrameError) -> None:
        """A frame that is not one valid message arrived; the link answers it and closes. Log it here."""
        ...

    def on_link_closed(self, link: ControlLink) -> None: ...


class ControlLink:
    """A framed, request/reply control connection."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        handler: LinkHandler,
        *,
        max_frame: int,
        timeout: float,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._handler = handler
        self.max_frame = max_frame
        self.timeout = timeout
        self.max_pending = max_pending
        self._ids = itertools.count(1)
        self._replies: dict[int, asyncio.Future[Reply]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._read_task: asyncio.Task[None] | None = None
        self._in_notice = False
        self._later: list[bytes] = []
        """Encoded notices ``post_soon`` queued for one write at the end of this loop iteration."""
        self._later_bytes = 0
        self._settling: asyncio.Task[None] | None = None
        self.closed = False
        self.last_activity = asyncio.get_running_loop().time()
        """Loop time of the last message read or written (for the idle timeout)."""
        peer = writer.get_extra_info("peername")
        self.peer_host = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        """The remote address without the port: what per-address limits and log rate limits are keyed on."""
        self.peer_address = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)

    def __repr__(self) -> str:
        return f"<ControlLink {self.peer_address}{' closed' if self.closed else ''}>"

    def start(self) -> None:
        """Start the reader task; a second call is an error (two readers would split the stream)."""
        if self._read_task is not None:
            raise RuntimeError(f"{self!r} was already started")
        self._read_task = asyncio.get_running_loop().create_task(self._read_loop())

    @property
    def busy(self) -> bool:
        """Something is under way on the link: a request either way, or a notice waiting for room."""
        return bool(self._replies or self._tasks or self._in_notice)

    @property
    def backlog(self) -> int:
        """Bytes written and not yet taken by the transport, or queued by ``post_soon`` (a peer that stops
        reading makes it grow)."""
        if self.closed:
            return 0
        return self._writer.transport.get_write_buffer_size() + self._later_bytes

    async def read_message(self, *, idle_ok: bool) -> Message | None:
        """One message, or None at a clean end of stream.

        Only the wait for a message's first byte may be unbounded (``idle_ok``);
        from there the whole message has one deadline, not one per read.
        """
        first = b""
        try:
            if idle_ok:
                first = await self._reader.readexactly(1)
            async with asyncio.timeout(self.timeout):
                header = first + await self._reader.readexactly(HEADER.size - len(first))
                body = await self._reader.readexactly(parse_header(header, self.max_frame))
        except asyncio.IncompleteReadError as exc:
            if exc.partial or first:
                raise FrameError("connection closed inside a frame") from None
            return None
        except TimeoutError:
            raise FrameError(f"no complete control message within {self.timeout:g}s") from None
        self.last_activity = asyncio.get_running_loop().time()
        return decode(body)

    async def send(self, message: Message) -> None:
        """Write one message and wait (within the timeout) for the transport to take it."""
        self._write(message)
        try:
            await asyncio.wait_for(self._writer.drain(), self.timeout)
        except (OSError, TimeoutError) as exc:
            self.close()
            raise ControlPlaneError(f"control link to {self.peer_address} failed: {exc!r}") from exc

    def post(self, notice: Notice) -> bool:
        """Write a small notice without waiting for the transport; False if the link is gone."""
        try:
            self._write(notice)
        except ControlPlaneError:
            return False
        return True

    def post_soon(self, notice: Notice) -> bool:
        """Like ``post``, but written together with the other notices posted in this loop iteration: one
        write (one send) for a burst. Anything written on the link meanwhile goes after them, so the
        order of messages is kept. False if the link is gone."""
        if self.closed or self._writer.is_closing():
            return False
        if not self._later:
            asyncio.get_running_loop().call_soon(self._write_later)
        data = encode(notice, self.max_frame)
        self._later.append(data)
        self._later_bytes += len(data)
        return True

    def _write_later(self) -> None:
        if self._later:
            with contextlib.suppress(ControlPlaneError):
                self._write_raw(b"")

    def _write(self, message: Message) -> None:
        self._write_raw(encode(message, self.max_frame))

    def _write_raw(self, data: bytes) -> None:
        if self.closed or self._writer.is_closing():
            self._later.clear()
            self._later_bytes = 0
            raise ControlPlaneError(f"control link to {self.peer_address} is closed")
        if self._later:  # notices posted earlier go first
            data = b"".join(self._later) + data
            self._later.clear()
            self._later_bytes = 0
        try:
            self._writer.write(data)
            self.last_activity = asyncio.get_running_loop().time()
        except RuntimeError as exc:  # uvloop: the transport closed under us
            self.close()
            raise ControlPlaneError(f"control link to {self.peer_address} failed: {exc!r}") from exc

    async def request(self, request: Hello | Proof | ConnectQp | ListMemory, expect: type[R]) -> R:
        """Send a request and await its reply; a refusal raises ``PeerError`` (``StalePeer``,
        ``AuthenticationError`` for those reasons)."""
        rid = next(self._ids)
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._replies[rid] = fut
        op = type(request).__struct_config__.tag
        try:
            # Not drained: the reply's deadline covers a transport that never takes it, and a connection
            # the peer refused and closed is reported by the reader, with the peer's reason, not as a reset.
            self._write(with_id(request, rid))
            try:
                reply = await asyncio.wait_for(fut, self.timeout)
            except TimeoutError:
                raise ControlPlaneError(
                    f"{op} to {self.peer_address}: no reply within {self.timeout:g}s",
                    hint="check that the peer engine is running and reachable",
                ) from None
        finally:
            self._replies.pop(rid, None)
        if isinstance(reply, Refused):
            raise _refusal(reply, f"{op} refused by {self.peer_address}")
        if expect is Challenge and isinstance(reply, Welcome):
            raise AuthenticationError(
                f"{op} to {self.peer_address}: the peer did not authenticate (it has no secret, or predates them)"
            )
        if not isinstance(reply, expect):
            raise ControlPlaneError(f"{op} to {self.peer_address} was answered with {type(reply).__name__}")
        return reply

    async def refuse(self, reason: str, message: str, request_id: int | None = None) -> None:
        """Send one ``Refused``; a link that is already gone is left as it is."""
        with contextlib.suppress(ControlPlaneError):
            await self.send(Refused(re=request_id, reason=reason, message=message))

    async def _read_loop(self) -> None:
        try:
            while not self.closed:
                try:
                    message = await self.read_message(idle_ok=True)
                except FrameError as exc:
                    self._handler.on_bad_frame(self, exc)
                    await self.refuse("frame", str(exc))
                    return
                if message is None:
                    return
                await self._dispatch(message)
        except (ConnectionError, OSError) as exc:
            log.debug("control link %s ended: %r", self.peer_address, exc)
        finally:
            self.close()

    async def _dispatch(self, message: Message) -> None:
        if isinstance(message, CloseQp | Notify | Done):
            self._in_notice = True
            try:
                await self._handler.on_notice(self, message)
            finally:
                self._in_notice = False
        elif isinstance(message, Hello | Proof | ConnectQp | ListMemory):
            while len(self._tasks) >= self.max_pending:  # stop reading: the sender's TCP window fills
                await asyncio.wait(list(self._tasks), return_when=asyncio.FIRST_COMPLETED)
            task = asyncio.get_running_loop().create_task(self._serve(message))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif isinstance(message, Refused) and message.re is None:
            # The peer refused a frame of ours, or this connection at accept, and closes: say why to every waiter.
            log.info("control link %s: the peer refused: %s", self.peer_address, message.message)
            self._fail_waiting(_refusal(message, f"{self.peer_address} closed the control link"))
        else:
            fut = self._replies.get(message.re) if message.re is not None else None
            if fut is not None and not fut.done():
                fut.set_result(message)

    def _fail_waiting(self, exc: ControlPlaneError) -> None:
        for fut in self._replies.values():
            if not fut.done():
                fut.set_exception(exc)
                fut.exception()

    async def _serve(self, request: Request) -> None:
        try:
            reply = await self._handler.on_request(self, request)
        except MoriioError as exc:  # a refusal the handler meant (a closing engine included): no traceback
            reply = Refused(reason=_REASONS.get(type(exc), "refused"), message=str(exc))
        except Exception as exc:  # a bug: say so once, answer, and keep the link's reader alive
            log.exception("control request %s from %s failed", type(request).__name__, self.peer_address)
            reply = Refused(reason="internal", message=f"{type(exc).__name__}: {exc}")
        if not self.closed:
            with contextlib.suppress(ControlPlaneError):
                await self.send(answering(reply, request.id))

    def close(self) -> None:
        """Close the connection, fail pending requests, stop the reader and request tasks. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._fail_waiting(ControlPlaneError(f"control link to {self.peer_address} closed"))
        transport = self._writer.transport
        if transport.get_write_buffer_size() > 0:
            # A peer that does not read would keep this socket (and its fd) open until it did, outside
            # every link limit: what it has not taken is dropped.
            transport.abort()
        else:
            self._writer.close()
        # Settled in a task of its own: the connection's close future may hold an error (a reset)
        # that must be retrieved, or asyncio reports it when the link is collected.
        self._settling = asyncio.get_running_loop().create_task(self._settle())
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        if self._read_task is not None and self._read_task is not current:
            self._read_task.cancel()
        self._handler.on_link_closed(self)

    async def _settle(self) -> None:
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()

    async def wait_closed(self) -> None:
        """Wait until the connection is closed and the link's tasks have ended (after ``close``)."""
        candidates = (self._settling, self._read_task, *self._tasks)
        tasks = [t for t in candidates if t is not None and t is not asyncio.current_task()]
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def _refusal(reply: Refused, what: str) -> ControlPlaneError:
    """The error a ``Refused`` reply stands for."""
    if reply.reason == "stale":
        return StalePeer(reply.message, hint="the peer restarted: connect() again and use its new descriptors")
    if reply.reason == "auth":
        return AuthenticationError(
            f"{what}: {reply.message}",
            hint="give both engines the same secret (IOEngineConfig.secret or $MORIIO_ASYNC_SECRET), or neither",
        )
    return PeerError(f"{what}: {reply.message}")
