"""The control plane survives malformed, oversized, slow and hostile peers."""

from __future__ import annotations

import asyncio
import json
import struct

import pytest

from moriio_async import IOEngine, IOEngineConfig, PeerError

from .conftest import Pair


async def raw_exchange(address: str, payload: bytes, *, read: bool = True) -> bytes:
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(payload)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 5) if read else b""
    finally:
        writer.close()
        await writer.wait_closed()


def frame(obj: object) -> bytes:
    body = json.dumps(obj).encode()
    return struct.pack("!I", len(body)) + body


def error_reason(reply: bytes) -> str:
    (n,) = struct.unpack("!I", reply[:4])
    msg = json.loads(reply[4 : 4 + n])
    assert msg["op"] == "error"
    return str(msg["reason"])


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\xff\xff\xff\xff garbage", "handshake"),  # oversized length
        (struct.pack("!I", 5) + b"nope!", "handshake"),  # not JSON
        (frame({"op": "connect_qp", "id": 1}), "handshake"),  # no hello first
        (frame({"op": "hello", "id": 1, "engine": {"key": 3}}), "handshake"),  # bad descriptor
    ],
)
async def test_bad_first_frames_get_an_error_and_the_listener_keeps_serving(
    pair: Pair, payload: bytes, reason: str
) -> None:
    reply = await raw_exchange(pair.b.address, payload)
    assert error_reason(reply) == reason
    peer = await pair.a.connect(pair.b.address)
    assert peer.engine.key == "b"


async def test_a_stalled_half_frame_is_dropped_after_the_control_timeout() -> None:
    async with IOEngine("b", IOEngineConfig(backend="mock", control_timeout=0.3)) as b:
        reply = await raw_exchange(b.address, struct.pack("!I", 100) + b"{")
        assert error_reason(reply) == "handshake"
        host, port = b.address.rsplit(":", 1)
        _, w = await asyncio.open_connection(host, int(port))  # says nothing at all
        await asyncio.sleep(0.5)
        w.close()
        async with IOEngine("a", IOEngineConfig(backend="mock")) as a:
            assert (await a.connect(b.address)).engine.key == "b"


async def test_malformed_frame_after_hello_closes_only_that_link(pair: Pair) -> None:
    hello = {
        "op": "hello",
        "id": 1,
        "engine": {
            "kind": "EngineDesc",
            "key": "evil",
            "host": "127.0.0.1",
            "port": 1,
            "incarnation": 1,
            "backend": "mock",
        },
    }
    reply = await raw_exchange(pair.b.address, frame(hello) + struct.pack("!I", 3) + b"]]]")
    assert b'"hello"' in reply and b'"frame"' in reply
    # The established link between a and b still works.
    await pair.a.notify("b", b"still here")
    assert (await pair.b.recv_notification(timeout=5)).data == b"still here"


async def test_unknown_request_is_refused_but_the_link_stays(pair: Pair) -> None:
    _, link = await pair.a._link_for("b")
    with pytest.raises(PeerError, match="unknown control op"):
        await link.request({"op": "launch_missiles"})
    with pytest.raises(PeerError, match="not base64"):
        await link.request({"op": "notify", "data": "!!!"})
    await pair.a.notify("b", b"ok")
    assert (await pair.b.recv_notification(timeout=5)).data == b"ok"


async def test_connect_to_nothing_fails_cleanly() -> None:
    async with IOEngine("a", IOEngineConfig(backend="mock", control_timeout=1)) as a:
        with pytest.raises(Exception, match="cannot reach engine"):
            await a.connect("127.0.0.1:1")
