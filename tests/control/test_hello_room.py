"""The control port's room for connections in their hello (``max_hellos``): how many, and who makes room.

Raw sockets stand in for peers that connect and prove nothing. A socket is
"talking" when its whole first frame reached the engine before the accept
(sent here before the loop runs again), as an honest dialer's hello does;
"silent" otherwise, also when it sent a byte or half a frame (a trickle).
Which socket the engine closed is read off the sockets themselves (end of
stream).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import pytest

from moriio_async import IOEngine, IOEngineConfig
from moriio_async.control.listener import Listener
from moriio_async.core.framing import HEADER

from .wire import until

CAP = 4


def dial(port: int, source: str, first: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
    if first:
        sock.sendall(first)  # before the loop runs: in the kernel when the engine accepts
    sock.setblocking(False)
    return sock


def closed_by_engine(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    held: list[socket.socket] = []
    yield held
    for sock in held:
        sock.close()


async def test_max_hellos_holds_that_many_and_a_newcomer_closes_the_oldest_silent_one(
    sockets: list[socket.socket],
) -> None:
    async with IOEngine("b", IOEngineConfig(backend="mock", max_hellos=CAP)) as b:
        port = int(b.address.rpartition(":")[2])
        # The oldest trickles (one byte of a frame), the next three say nothing: CAP in their hello.
        sockets.append(dial(port, "127.1.0.1", first=b"\x00"))
        await until(lambda: b.statistics().peers.links == 1)
        for i in range(2, CAP + 1):
            sockets.append(dial(port, f"127.1.0.{i}"))
            await until(lambda i=i: b.statistics().peers.links == i)
        assert b.statistics().guard.evicted_hellos == 0
        assert not any(closed_by_engine(s) for s in sockets), "at the cap, not over it: nobody made room yet"

        sockets.append(dial(port, f"127.1.0.{CAP + 1}"))  # one over the cap
        await until(lambda: b.statistics().guard.evicted_hellos == 1 or b.statistics().peers.links > CAP)
        assert b.statistics().peers.links == CAP, "the cap is max_hellos, the newcomer's place made"
        assert b.statistics().guard.evicted_hellos == 1
        # The oldest made room (a trickle is as silent as nothing), not a younger one.
        await until(lambda: closed_by_engine(sockets[0]))
        assert [closed_by_engine(s) for s in sockets[1:]] == [False] * CAP


async def test_the_listener_hears_talking_only_of_a_client_whose_whole_first_frame_came_before_its_accept(
    sockets: list[socket.socket],
) -> None:
    """One byte, half a frame or an empty one is not talking; a whole frame (an honest dialer's hello, one write) is."""
    heard: list[bool] = []

    def has_room(pending: int, talking: bool) -> str | None:
        heard.append(talking)
        return None

    streams: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    listener = Listener(lambda reader, writer: streams.append((reader, writer)), has_room=has_room)
    port = await listener.start("127.0.0.1", 0)
    whole = HEADER.pack(100) + b"h" * 100
    firsts = [b"", b"\x00", whole[:50], HEADER.pack(0), whole, whole + b"more"]
    try:
        for first in firsts:  # connected and sent before the loop looks: accepted in this order
            sockets.append(dial(port, "127.0.0.1", first=first))
        await until(lambda: len(streams) == len(firsts))
        assert heard == [False, False, False, False, True, True]
        assert await streams[4][0].readexactly(len(whole)) == whole  # peeked and counted, never read
    finally:
        for _, writer in streams:
            writer.close()
        await listener.close()
