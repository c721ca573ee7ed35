"""No log flood from rotating source addresses (issue 23, item 4), on the control and the TCP data port.

The WARNING limit was per address, so 2,000 bad frames from 2,000 addresses
of 127/8 gave 2,000 lines (600 KB) in 1.1 s. Every line also shares one
budget for all addresses together (``core.ratelog``): here a thousand bad
frames from a thousand addresses give at most that many lines, and every one
is still counted.
"""

from __future__ import annotations

import asyncio
import logging
import struct

import pytest

from moriio_async import IOEngine, IOEngineConfig

from ..control.wire import close, closed_by_peer, frame, until
from .conftest import tcp_facts

pytestmark = pytest.mark.timeout(120)

ADDRESSES = 1000
GLOBAL_BURST = 20
"""``RateLimitedLog``'s default budget for all keys together, per interval (10 s)."""


def source(i: int) -> str:
    return f"127.3.{i // 250}.{i % 250 + 1}"


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name.startswith("moriio_async") and r.levelno >= logging.WARNING
    ]


async def bad_frame_from(src: str, host: str, port: int, data: bytes) -> None:
    reader, writer = await asyncio.open_connection(host, port, local_addr=(src, 0))
    try:
        writer.write(data)
        await writer.drain()
        assert await closed_by_peer(reader)
    finally:
        await close(writer)


async def test_bad_control_frames_from_a_thousand_addresses_give_a_few_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    async with IOEngine("b", IOEngineConfig(backend="tcp", secret="")) as b:
        host, _, port = b.address.rpartition(":")
        caplog.clear()
        for batch in range(0, ADDRESSES, 50):
            await asyncio.gather(
                *(bad_frame_from(source(i), host, int(port), frame({"op": "memory", "id": 1}))
                  for i in range(batch, batch + 50))
            )  # fmt: skip
        await until(lambda: b.statistics().guard.rogue_hellos >= ADDRESSES)
        lines = warnings(caplog)
        assert len(lines) <= GLOBAL_BURST, f"{len(lines)} lines for {ADDRESSES} bad frames"
        assert b.statistics().suppressed_log_lines >= ADDRESSES - GLOBAL_BURST


async def test_bad_data_port_hellos_from_a_thousand_addresses_give_a_few_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    async with IOEngine("b", IOEngineConfig(backend="tcp", secret="")) as b:
        port = tcp_facts(b).data_port
        caplog.clear()
        not_a_hello = struct.pack("<4sHH16sI", b"HTTP", 1, 0, bytes(16), 0)  # a hello's size, the wrong magic
        for batch in range(0, ADDRESSES, 50):
            await asyncio.gather(
                *(bad_frame_from(source(i), "127.0.0.1", port, not_a_hello) for i in range(batch, batch + 50))
            )
        await until(lambda: tcp_facts(b).data_plane.bad_messages >= ADDRESSES)
        lines = warnings(caplog)
        assert len(lines) <= GLOBAL_BURST, f"{len(lines)} lines for {ADDRESSES} bad hellos"
        assert tcp_facts(b).data_plane.suppressed_log_lines >= ADDRESSES - GLOBAL_BURST
