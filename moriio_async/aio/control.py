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

Every read of a frame body has a deadline, and so has the first header; a
malformed or oversized frame gets one error reply and the link is closed,
which the listener survives.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from typing import Protocol, TypeVar

from ..core.framing import HEADER, FrameError, parse_header
from ..core.protocol import (
    CloseQp,
    ConnectQp,
    Exports,
    Hello,
    ListMemory,
    Message,
    Notice,
    Notify,
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
from ..errors import ControlPlaneError, EngineClosed, MoriioError, PeerError, StalePeer

__all__ = ["ControlLink", "LinkHandler"]

log = logging.getLogger("moriio_async")

R = TypeVar("R", Welcome, QpReady, Exports)
_REASONS: dict[type[MoriioError], str] = {StalePeer: "stale", EngineClosed: "closed"}


class LinkHandler(Protocol):
    """What a link hands its peer's frames to (the engine's peer table)."""

    async def on_request(self, link: ControlLink, request: Request) -> Reply:
        """The reply to send. Raising a ``MoriioError`` sends a ``Refused`` instead (``StalePeer``: "stale",
        ``EngineClosed``: "closed", others: "refused"); anything else is logged as a bug ("internal")."""
        ...

    def on_notice(self, link: ControlLink, notice: Notice) -> None:
        """Called by the reader, in arrival order; must not block."""
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
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._handler = handler
        self.max_frame = max_frame
        self.timeout = timeout
        self._ids = itertools.count(1)
        self._replies: dict[int, asyncio.Future[Reply]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._read_task: asyncio.Task[None] | None = None
        self.closed = False
        peer = writer.get_extra_info("peername")
        self.peer_address = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)

    def __repr__(self) -> str:
        return f"<ControlLink {self.peer_address}{' closed' if self.closed else ''}>"

    def start(self) -> None:
        """Start the reader task; a second call is an error (two readers would split the stream)."""
        if self._read_task is not None:
            raise RuntimeError(f"{self!r} was already started")
        self._read_task = asyncio.get_running_loop().create_task(self._read_loop())

    async def read_message(self, *, idle_ok: bool) -> Message | None:
        """One message, or None at a clean end of stream. Only the wait for a header may be unbounded."""
        try:
            if idle_ok:
                header = await self._reader.readexactly(HEADER.size)
            else:
                header = await asyncio.wait_for(self._reader.readexactly(HEADER.size), self.timeout)
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise FrameError("connection closed inside a frame header") from None
            return None
        except TimeoutError:
            raise FrameError(f"no frame within {self.timeout:g}s") from None
        length = parse_header(header, self.max_frame)
        try:
            body = await asyncio.wait_for(self._reader.readexactly(length), self.timeout)
        except asyncio.IncompleteReadError:
            raise FrameError("connection closed inside a frame") from None
        except TimeoutError:
            raise FrameError(f"frame body not complete within {self.timeout:g}s") from None
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

    def _write(self, message: Message) -> None:
        if self.closed or self._writer.is_closing():
            raise ControlPlaneError(f"control link to {self.peer_address} is closed")
        try:
            self._writer.write(encode(message, self.max_frame))
        except RuntimeError as exc:  # uvloop: the transport closed under us
            self.close()
            raise ControlPlaneError(f"control link to {self.peer_address} failed: {exc!r}") from exc

    async def request(self, request: Hello | ConnectQp | ListMemory, expect: type[R]) -> R:
        """Send a request and await its reply; a refusal raises ``PeerError`` (or ``StalePeer``)."""
        rid = next(self._ids)
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._replies[rid] = fut
        op = type(request).__struct_config__.tag
        try:
            await self.send(with_id(request, rid))
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
            if reply.reason == "stale":
                raise StalePeer(reply.message, hint="the peer restarted: connect() again and use its new descriptors")
            raise PeerError(f"{op} refused by {self.peer_address}: {reply.message}")
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
                    log.warning("control link %s: %s; closing it", self.peer_address, exc)
                    await self.refuse("frame", str(exc))
                    return
                if message is None:
                    return
                self._dispatch(message)
        except (ConnectionError, OSError) as exc:
            log.info("control link %s ended: %r", self.peer_address, exc)
        finally:
            self.close()

    def _dispatch(self, message: Message) -> None:
        if isinstance(message, CloseQp | Notify):
            self._handler.on_notice(self, message)
        elif isinstance(message, Hello | ConnectQp | ListMemory):
            task = asyncio.get_running_loop().create_task(self._serve(message))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif isinstance(message, Refused) and message.re is None:
            log.info("control link %s: the peer refused a frame: %s", self.peer_address, message.message)
        else:
            fut = self._replies.get(message.re) if message.re is not None else None
            if fut is not None and not fut.done():
                fut.set_result(message)

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
        for fut in self._replies.values():
            if not fut.done():
                fut.set_exception(ControlPlaneError(f"control link to {self.peer_address} closed"))
                fut.exception()
        self._writer.close()
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        if self._read_task is not None and self._read_task is not current:
            self._read_task.cancel()
        self._handler.on_link_closed(self)

    async def wait_closed(self) -> None:
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()
        tasks = [t for t in (self._read_task, *self._tasks) if t is not None and t is not asyncio.current_task()]
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
