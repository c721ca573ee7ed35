"""One control link, both ends in the test: request ids and replies, refusals and the error each reason
raises, the timeout, bad frames, close, and read_message's bounds; and how a link ends its connection
(aborted while its peer has bytes not taken, closed cleanly with none)."""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import struct
from pathlib import Path
from typing import Any

import pytest

from moriio_async import ControlPlaneError, StalePeer
from moriio_async.control.link import ControlLink
from moriio_async.core.framing import FrameError
from moriio_async.core.protocol import Challenge, Exports, ListMemory, Notify, Refused, Reply, Request, encode
from moriio_async.errors import AuthenticationError, PeerError

from .linkpair import WELCOME, Handler, linked
from .wire import frame


async def test_requests_are_numbered_from_one_and_each_gets_its_own_reply() -> None:
    async def answer(request: Request) -> Reply:
        await asyncio.sleep(0.05 if request.id == 1 else 0)  # the first one is answered last
        return Exports() if request.id == 1 else WELCOME

    server = Handler(answer)
    async with linked(server) as ends:
        first = asyncio.get_running_loop().create_task(ends.client.request(ListMemory(), Exports))
        await asyncio.sleep(0)
        assert ends.client.busy
        with pytest.raises(ControlPlaneError, match=rf"^memory to {ends.address} was answered with Welcome$"):
            await ends.client.request(ListMemory(), Exports)
        reply = await first
        assert isinstance(reply, Exports) and reply.re == 1
        assert [r.id for r in server.requests] == [1, 2]
        assert server.links == [ends.server] * 2
        assert not ends.client.busy and not ends.server.busy
        assert ends.client.peer_address == ends.address and ends.client.peer_host == "127.0.0.1"
        assert ends.client.closed is False and ends.server.closed is False
        assert repr(ends.client) == f"<ControlLink {ends.address}>"


async def test_a_welcome_where_a_challenge_was_expected_is_an_authentication_error() -> None:
    async def welcome(request: Request) -> Reply:
        return WELCOME

    async with linked(Handler(welcome)) as ends:
        with pytest.raises(
            AuthenticationError,
            match=rf"^memory to {ends.address}: the peer did not authenticate \(it has no secret, or predates them\)$",
        ):
            await ends.client.request(ListMemory(), Challenge)


@pytest.mark.parametrize(
    ("raised", "error", "says", "hint"),
    [
        (
            StalePeer("b restarted"),
            StalePeer,
            "^b restarted",
            "the peer restarted: connect() again and use its new descriptors",
        ),
        (
            AuthenticationError("bad proof"),
            AuthenticationError,
            "^memory refused by {}: bad proof",
            "give both engines the same secret (IOEngineConfig.secret or $MORIIO_ASYNC_SECRET), or neither",
        ),
        (ControlPlaneError("no such pair"), PeerError, "^memory refused by {}: no such pair$", None),
        (RuntimeError("a bug"), PeerError, "^memory refused by {}: RuntimeError: a bug$", None),
    ],
    ids=["stale", "auth", "refused", "internal"],
)
async def test_a_refusal_raises_the_error_its_reason_stands_for(
    raised: Exception, error: type[ControlPlaneError], says: str, hint: str | None
) -> None:
    async def refuse(request: Request) -> Reply:
        raise raised

    async with linked(Handler(refuse)) as ends:
        with pytest.raises(error, match=says.format(ends.address)) as info:
            await ends.client.request(ListMemory(), Exports)
        assert type(info.value) is error
        if hint is None:
            assert info.value.hint is None
        else:
            assert info.value.hint == hint
        assert not ends.client.closed and not ends.server.closed  # a refusal keeps the link


async def test_no_reply_within_the_timeout() -> None:
    never = asyncio.Event()

    async def hang(request: Request) -> Reply:
        await never.wait()
        return Exports()

    async with linked(Handler(hang), timeout=0.2) as ends:
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(
            ControlPlaneError, match=rf"^memory to {ends.address}: no reply within 0.2s \(hint: "
        ) as info:
            await ends.client.request(ListMemory(), Exports)
        assert 0.2 - 1e-3 <= loop.time() - start < 2
        assert info.value.hint == "check that the peer engine is running and reachable"
        assert not ends.client.busy  # the request is forgotten
        assert ends.server.busy  # the peer still serves it


async def test_a_bad_frame_is_answered_once_and_fails_the_requests_waiting_on_that_link(
    caplog: pytest.LogCaptureFixture,
) -> None:
    never = asyncio.Event()

    async def hang(request: Request) -> Reply:
        await never.wait()
        return Exports()

    server, client = Handler(hang), Handler()
    async with linked(server, client) as ends:
        asking = asyncio.get_running_loop().create_task(ends.client.request(ListMemory(), Exports))
        await asyncio.sleep(0.02)
        with caplog.at_level(logging.INFO, logger="moriio_async"):
            ends.writer.write(frame(b"]]]"))
            with pytest.raises(PeerError, match=rf"^{ends.address} closed the control link: ") as info:
                await asyncio.wait_for(asking, 5)
        why = str(info.value).removeprefix(f"{ends.address} closed the control link: ")
        assert why.startswith("frame is not a JSON message: ")
        infos = [r.getMessage() for r in caplog.records if r.name == "moriio_async" and r.levelno == logging.INFO]
        assert infos == [f"control link {ends.address}: the peer refused: {why}"]
        assert len(server.bad) == 1 and server.bad[0][0] is ends.server and isinstance(server.bad[0][1], FrameError)
        for _ in range(200):
            if ends.client.closed:
                break
            await asyncio.sleep(0.005)
        assert ends.server.closed and ends.client.closed
        assert server.closed == [ends.server] and client.closed == [ends.client]


async def test_closing_a_link_fails_its_waiters_and_refuses_more() -> None:
    never = asyncio.Event()

    async def hang(request: Request) -> Reply:
        await never.wait()
        return Exports()

    client = Handler()
    async with linked(Handler(hang), client) as ends:
        asking = asyncio.get_running_loop().create_task(ends.client.request(ListMemory(), Exports))
        await asyncio.sleep(0.02)
        ends.client.close()
        ends.client.close()
        assert client.closed == [ends.client]
        with pytest.raises(ControlPlaneError, match=rf"^control link to {ends.address} closed$"):
            await asking
        assert repr(ends.client) == f"<ControlLink {ends.address} closed>"
        assert ends.client.backlog == 0
        assert not ends.client.post(Notify(data=b"x")) and not ends.client.post_soon(Notify(data=b"x"))
        with pytest.raises(ControlPlaneError, match=rf"^control link to {ends.address} is closed$"):
            await ends.client.send(Notify(data=b"x"))


async def test_read_message_bounds_the_whole_message_and_tells_a_cut_from_a_clean_end() -> None:
    async with linked(Handler(), timeout=0.2, start=False) as ends:
        loop = asyncio.get_running_loop()
        ends.writer.write(b"\x00")  # a frame begun, then nothing: its deadline runs from that byte
        start = loop.time()
        with pytest.raises(FrameError, match=r"^no complete control message within 0.2s$"):
            async with asyncio.timeout(2):  # a read that waited unbounded for more than that byte
                await ends.server.read_message(idle_ok=True)
        assert loop.time() - start < 2
    async with linked(Handler(), start=False) as ends:
        ends.writer.write(b"\x00\x00\x00\x05{")
        ends.writer.write_eof()
        with pytest.raises(FrameError, match=r"^connection closed inside a frame$"):
            await ends.server.read_message(idle_ok=True)
    async with linked(Handler(), start=False) as ends:
        ends.writer.write(b"\x00")
        ends.writer.write_eof()
        with pytest.raises(FrameError, match=r"^connection closed inside a frame$"):
            await ends.server.read_message(idle_ok=True)  # one byte is a frame begun


async def test_a_message_read_moves_last_activity_and_a_clean_end_is_none() -> None:
    async with linked(Handler(), start=False) as ends:
        before = ends.server.last_activity
        await asyncio.sleep(0.02)
        ends.writer.write(encode(Notify(data=b"hi")))
        assert await ends.server.read_message(idle_ok=False) == Notify(data=b"hi")
        assert ends.server.last_activity >= before + 0.01
        sent = ends.client.last_activity
        await asyncio.sleep(0.02)
        assert ends.client.post(Notify(data=b"x"))
        assert ends.client.last_activity >= sent + 0.01
        assert await ends.server.read_message(idle_ok=True) == Notify(data=b"x")
        ends.writer.write_eof()
        assert await ends.server.read_message(idle_ok=True) is None


async def test_a_link_over_a_unix_socket_is_named_by_its_path(tmp_path: Path) -> None:
    path = str(tmp_path / "control.sock")
    accepted: list[asyncio.StreamWriter] = []
    server = await asyncio.start_unix_server(lambda r, w: accepted.append(w), path)
    reader, writer = await asyncio.open_unix_connection(path)
    link = ControlLink(reader, writer, Handler(), max_frame=1 << 16, timeout=5)
    try:
        assert (link.peer_host, link.peer_address, repr(link)) == (path, path, f"<ControlLink {path}>")
    finally:
        link.close()
        await link.wait_closed()
        for w in accepted:
            w.close()
        server.close()
        await server.wait_closed()


async def test_a_frame_longer_than_the_links_limit_is_refused_by_its_header() -> None:
    async with linked(Handler(), start=False) as ends:
        ends.writer.write((70_000).to_bytes(4, "big"))  # over this link's 65536, under the default limit
        with pytest.raises(FrameError, match=r"^frame length 70000 outside 1\.\.65536$"):
            await ends.server.read_message(idle_ok=True)


async def test_refuse_answers_the_request_it_names_and_is_quiet_on_a_closed_link() -> None:
    async with linked(Handler(), start=False) as ends:
        await ends.server.refuse("stale", "gone", 7)
        await ends.server.refuse("frame", "bad")
        assert await ends.client.read_message(idle_ok=True) == Refused(re=7, reason="stale", message="gone")
        assert await ends.client.read_message(idle_ok=True) == Refused(re=None, reason="frame", message="bad")
        ends.server.close()
        await ends.server.refuse("closed", "no one hears this", 8)  # the link is gone: nothing is raised


async def test_a_bad_frame_is_answered_with_the_reason_frame() -> None:
    async with linked(Handler(), start=False) as ends:
        ends.server.start()
        ends.writer.write(frame(b"]]]"))
        reply = await asyncio.wait_for(ends.client.read_message(idle_ok=True), 5)
        assert isinstance(reply, Refused) and (reply.re, reply.reason) == (None, "frame")
        assert reply.message.startswith("frame is not a JSON message: ")


async def test_a_link_reset_by_its_peer_ends_with_one_debug_line(caplog: pytest.LogCaptureFixture) -> None:
    server = Handler()
    async with linked(server) as ends:
        with caplog.at_level(logging.DEBUG, logger="moriio_async"):
            ends.writer.transport.get_extra_info("socket").setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
            )
            ends.writer.transport.abort()  # a reset, not a clean end
            for _ in range(200):
                if ends.server.closed:
                    break
                await asyncio.sleep(0.005)
        assert ends.server.closed and server.closed == [ends.server]
        lines = [r.getMessage() for r in caplog.records if r.name == "moriio_async"]
        assert lines == [
            f"control link {ends.server.peer_address} ended: ConnectionResetError(104, 'Connection reset by peer')"
        ]


@pytest.mark.parametrize(
    ("raised", "reason", "message", "logged"),
    [
        (StalePeer("b restarted"), "stale", "b restarted", False),
        (ControlPlaneError("no such pair"), "refused", "no such pair", False),
        (RuntimeError("a bug"), "internal", "RuntimeError: a bug", True),
    ],
    ids=["stale", "refused", "internal"],
)
async def test_a_refusal_on_the_wire_says_its_reason_and_only_a_bug_is_logged(
    raised: Exception, reason: str, message: str, logged: bool, caplog: pytest.LogCaptureFixture
) -> None:
    async def refuse(request: Request) -> Reply:
        raise raised

    async with linked(Handler(refuse), start=False) as ends:
        ends.server.start()
        ends.writer.write(encode(ListMemory(id=4)))
        reply = await asyncio.wait_for(ends.client.read_message(idle_ok=True), 5)
        assert reply == Refused(re=4, reason=reason, message=message)
        errors = [(r.getMessage(), r.exc_info is not None) for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors == (
            [(f"control request ListMemory from {ends.server.peer_address} failed", True)] if logged else []
        )


async def test_a_reset_link_dropped_without_waiting_leaves_no_error_behind() -> None:
    """The error a reset leaves in the connection's close is retrieved by the link itself: a closed link
    nobody waited for is collected without asyncio reporting it (the loop's handler fails the test)."""
    links: list[ControlLink] = []

    def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        links.append(ControlLink(reader, writer, Handler(), max_frame=1 << 16, timeout=5))
        links[-1].start()

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    client = socket.create_connection(server.sockets[0].getsockname()[:2])
    try:
        for _ in range(200):
            if links:
                break
            await asyncio.sleep(0.005)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()  # a reset
        for _ in range(200):
            if links[0].closed:
                break
            await asyncio.sleep(0.005)
        for _ in range(10):
            await asyncio.sleep(0.01)  # the close settles
        assert links[0].closed
        links.clear()
        gc.collect()
        await asyncio.sleep(0)
    finally:
        client.close()
        server.close()
        await server.wait_closed()


# -- how a link ends its connection: aborted with bytes unsent, closed cleanly with none -----------------


class Transport(asyncio.Transport):
    """A connection whose unsent byte count the test sets; records how it was ended."""

    def __init__(self, unsent: int) -> None:
        super().__init__()
        self.unsent = unsent
        self.ended: list[str] = []
        self.protocol: asyncio.BaseProtocol | None = None

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("192.0.2.7", 4000) if name == "peername" else default

    def get_write_buffer_size(self) -> int:
        return self.unsent

    def is_closing(self) -> bool:
        return bool(self.ended)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        raise AssertionError("nothing is written in these tests")

    def close(self) -> None:
        self._end("close")

    def abort(self) -> None:
        self._end("abort")

    def _end(self, how: str) -> None:
        self.ended.append(how)
        assert self.protocol is not None
        asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)


def link_over(transport: Transport) -> ControlLink:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    protocol = asyncio.StreamReaderProtocol(reader)
    transport.protocol = protocol
    protocol.connection_made(transport)
    writer = asyncio.StreamWriter(transport, protocol, reader, loop)
    return ControlLink(reader, writer, Handler(), max_frame=1 << 16, timeout=5)


@pytest.mark.parametrize(("unsent", "ended"), [(0, "close"), (1, "abort"), (2, "abort"), (1 << 20, "abort")])
async def test_a_link_closed_with_unsent_bytes_aborts_its_connection(unsent: int, ended: str) -> None:
    transport = Transport(unsent)
    link = link_over(transport)
    assert link.peer_address == "192.0.2.7:4000"
    link.close()
    await asyncio.wait_for(link.wait_closed(), 5)
    assert transport.ended == [ended]
    link.close()  # once closed, closing again touches nothing
    assert transport.ended == [ended]
