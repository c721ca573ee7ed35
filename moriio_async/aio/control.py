"""Control-plane links: framed JSON requests, replies and notifications over asyncio streams.

One link per connection, in either direction, with one reader task for the
link's life (never one per message). Requests carry an ``id`` and replies a
``re``; notifications carry neither and are delivered in arrival order. Every
read of a frame's body has a deadline; a malformed or oversized frame gets an
error reply and the link is closed, which the listener survives.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ..core.framing import HEADER, FrameError, decode_body, encode_frame, parse_header
from ..errors import ControlPlaneError, PeerError, StalePeer

__all__ = ["ControlLink", "Handler"]

log = logging.getLogger("moriio_async")

Handler = Callable[["ControlLink", dict[str, Any]], Awaitable[dict[str, Any] | None]]


class ControlLink:
    """A framed, request/reply control connection."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        handler: Handler,
        *,
        max_frame: int,
        timeout: float,
        on_close: Callable[[ControlLink], None] = lambda link: None,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._handler = handler
        self.max_frame = max_frame
        self.timeout = timeout
        self._on_close = on_close
        self._ids = itertools.count(1)
        self._replies: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._read_task: asyncio.Task[None] | None = None
        self.closed = False
        self.peer_key: str | None = None
        peer = writer.get_extra_info("peername")
        self.peer_address = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)

    def start(self) -> None:
        self._read_task = asyncio.get_running_loop().create_task(self._read_loop())

    async def read_frame(self, *, idle_ok: bool) -> dict[str, Any] | None:
        """One frame, or None at a clean end of stream. Only the wait for a header may be unbounded."""
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
        return decode_body(body)

    async def send(self, message: dict[str, Any]) -> None:
        if self.closed:
            raise ControlPlaneError(f"control link to {self.peer_address} is closed")
        self._writer.write(encode_frame(message, self.max_frame))
        try:
            await asyncio.wait_for(self._writer.drain(), self.timeout)
        except (OSError, TimeoutError) as exc:
            self.close()
            raise ControlPlaneError(f"control link to {self.peer_address} failed: {exc!r}") from exc

    async def request(self, message: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """Send a request and await its reply; an error reply raises ``PeerError`` (or ``StalePeer``)."""
        rid = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._replies[rid] = fut
        try:
            await self.send({**message, "id": rid})
            try:
                reply = await asyncio.wait_for(fut, timeout if timeout is not None else self.timeout)
            except TimeoutError:
                raise ControlPlaneError(
                    f"{message.get('op')} to {self.peer_address}: no reply within {self.timeout:g}s",
                    hint="check that the peer engine is running and reachable",
                ) from None
        finally:
            self._replies.pop(rid, None)
        if reply.get("op") == "error":
            text = str(reply.get("message", "error"))
            if reply.get("reason") == "stale":
                raise StalePeer(text, hint="the peer restarted: connect() again and use its new descriptors")
            raise PeerError(f"{message.get('op')} refused by {self.peer_address}: {text}")
        return reply

    async def _read_loop(self) -> None:
        try:
            while not self.closed:
                try:
                    message = await self.read_frame(idle_ok=True)
                except FrameError as exc:
                    log.warning("control link %s: %s; closing it", self.peer_address, exc)
                    with contextlib.suppress(ControlPlaneError):
                        await self.send({"op": "error", "reason": "frame", "message": str(exc)})
                    return
                if message is None:
                    return
                self._dispatch(message)
        except (ConnectionError, OSError) as exc:
            log.info("control link %s ended: %r", self.peer_address, exc)
        finally:
            self.close()

    def _dispatch(self, message: dict[str, Any]) -> None:
        rid = message.get("re")
        if rid is not None:
            fut = self._replies.get(rid) if isinstance(rid, int) else None
            if fut is not None and not fut.done():
                fut.set_result(message)
            return
        task = asyncio.get_running_loop().create_task(self._handle(message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle(self, message: dict[str, Any]) -> None:
        rid = message.get("id")
        try:
            reply = await self._handler(self, message)
        except ControlPlaneError as exc:
            reason = "stale" if isinstance(exc, StalePeer) else "refused"
            reply = {"op": "error", "reason": reason, "message": str(exc)}
        except Exception as exc:  # a bad request must not kill the link's reader
            log.exception("control request %r failed", message.get("op"))
            reply = {"op": "error", "reason": "internal", "message": f"{type(exc).__name__}: {exc}"}
        if isinstance(rid, int) and reply is not None and not self.closed:
            with contextlib.suppress(ControlPlaneError):
                await self.send({**reply, "re": rid})

    def close(self) -> None:
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
        self._on_close(self)

    async def wait_closed(self) -> None:
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()
        if self._read_task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._read_task
