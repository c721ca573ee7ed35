"""The control port's room for connections in their hello (``max_hellos``): how many, and who makes room.

Raw sockets stand in for peers that connect and prove nothing. A socket is
"talking" when a byte of it reached the engine before the accept (sent here
before the loop runs again), "silent" otherwise. Which socket the engine
closed is read off the sockets themselves (end of stream).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from moriio_async import IOEngine, IOEngineConfig

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
        # The oldest is talking (one byte of a frame), the next three are silent: CAP in their hello.
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
        # The oldest silent one made room: not the talking one before it, not a younger silent one.
        await until(lambda: closed_by_engine(sockets[1]))
        assert [closed_by_engine(s) for s in sockets[2:]] == [False] * (CAP - 1)
        assert not closed_by_engine(sockets[0]), "a connection that said something outlasts silent ones"
