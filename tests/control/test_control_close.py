"""How a control link ends its connection: with bytes its peer has not taken, any at all, the connection is
aborted (a peer that stops reading cannot keep the socket open); with none, it is closed cleanly."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from moriio_async.control.link import ControlLink

from .linkpair import Handler


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
