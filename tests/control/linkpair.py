"""Both ends of one control link in a test: a handler that records what reaches it, and the pair of links."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from moriio_async.control.link import ControlLink
from moriio_async.core.framing import FrameError
from moriio_async.core.protocol import Exports, Notice, Reply, Request, Welcome
from moriio_async.descriptors import EngineDesc

WELCOME = Welcome(engine=EngineDesc("b", "", 0, 1, "mock"))
Answer = Callable[[Request], Awaitable[Reply]]


async def exports(request: Request) -> Reply:
    return Exports()


@dataclass
class Handler:
    """A link handler that records what reached it; ``answer`` makes each reply, ``gate`` holds notices."""

    answer: Answer = exports
    gate: asyncio.Event | None = None
    requests: list[Request] = field(default_factory=list)
    notices: list[Notice] = field(default_factory=list)
    bad: list[tuple[ControlLink, FrameError]] = field(default_factory=list)
    closed: list[ControlLink] = field(default_factory=list)
    links: list[ControlLink] = field(default_factory=list)
    """The link each request and notice came with."""

    async def on_request(self, link: ControlLink, request: Request) -> Reply:
        self.requests.append(request)
        self.links.append(link)
        return await self.answer(request)

    async def on_notice(self, link: ControlLink, notice: Notice) -> None:
        self.notices.append(notice)
        self.links.append(link)
        if self.gate is not None:
            await self.gate.wait()

    def on_bad_frame(self, link: ControlLink, error: FrameError) -> None:
        self.bad.append((link, error))

    def on_link_closed(self, link: ControlLink) -> None:
        self.closed.append(link)


@dataclass
class Ends:
    client: ControlLink
    server: ControlLink
    address: str
    """The server's address as the client sees it (host:port)."""
    writer: asyncio.StreamWriter
    """The client's stream, to write by hand what the link would not."""


@asynccontextmanager
async def linked(
    server: Handler, client: Handler | None = None, *, timeout: float = 5, max_pending: int = 32, start: bool = True
) -> AsyncIterator[Ends]:
    accepted: asyncio.Future[ControlLink] = asyncio.get_running_loop().create_future()

    def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = ControlLink(reader, writer, server, max_frame=1 << 16, timeout=timeout, max_pending=max_pending)
        if start:
            link.start()
        accepted.set_result(link)

    listening = await asyncio.start_server(accept, "127.0.0.1", 0)
    host, port = listening.sockets[0].getsockname()[:2]
    reader, writer = await asyncio.open_connection(host, port)
    near = ControlLink(reader, writer, client or Handler(), max_frame=1 << 16, timeout=timeout)
    if start:
        near.start()
    far = await asyncio.wait_for(accepted, 5)
    try:
        yield Ends(near, far, f"{host}:{port}", writer)
    finally:
        for link in (near, far):
            link.close()
            await link.wait_closed()
        listening.close()
        await listening.wait_closed()
