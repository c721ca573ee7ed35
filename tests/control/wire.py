"""A hostile (or merely hand-written) control-plane client: length prefix + JSON, spoken by hand.

Nothing here uses the runtime's own framing or messages, so the tests check
the wire as another implementation would see it. ``hello`` speaks the whole
hello, with the challenge and proof when given a secret (``core.auth`` is the
reference for the HMAC), or deliberately wrong when told to.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import struct
from dataclasses import dataclass
from typing import Any

from moriio_async.core.auth import Transcript, load_secret

ENV_SECRET = load_secret(None)
"""The secret engines made with a default config use in this run (``$MORIIO_ASYNC_SECRET``), or None."""


def frame(obj: object) -> bytes:
    body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return struct.pack("!I", len(body)) + body


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def messages(stream: bytes) -> list[dict[str, Any]]:
    """Every frame in ``stream``, decoded."""
    out = []
    while stream:
        (n,) = struct.unpack("!I", stream[:4])
        out.append(json.loads(stream[4 : 4 + n]))
        stream = stream[4 + n :]
    return out


def engine_fields(key: str, backend: str = "mock", incarnation: int = 1) -> dict[str, Any]:
    return {"kind": "EngineDesc", "key": key, "host": "127.0.0.1", "port": 1, "incarnation": incarnation,
            "backend": backend}  # fmt: skip


def proven_transports(dialer: dict[str, Any], listener: dict[str, Any]) -> bytes:
    """What the proofs cover of both ends' transports (compact JSON lists of name and scope, a newline
    between them), as the protocol specifies; nothing if neither end lists any."""

    def listed(engine: dict[str, Any]) -> bytes:
        items = [{"name": t["name"], "scope": t.get("scope", "")} for t in engine.get("transports", [])]
        return json.dumps(items, separators=(",", ":")).encode()

    if not dialer.get("transports") and not listener.get("transports"):
        return b""
    return listed(dialer) + b"\n" + listed(listener)


async def open_raw(address: str, source: str | None = None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw connection to ``address``, from the local address ``source`` if given."""
    host, port = address.rsplit(":", 1)
    return await asyncio.open_connection(host, int(port), local_addr=(source, 0) if source else None)


async def read_message(reader: asyncio.StreamReader, timeout: float = 5) -> dict[str, Any]:
    (n,) = struct.unpack("!I", await asyncio.wait_for(reader.readexactly(4), timeout))
    message: dict[str, Any] = json.loads(await asyncio.wait_for(reader.readexactly(n), timeout))
    return message


async def closed_by_peer(reader: asyncio.StreamReader, timeout: float = 5) -> bool:
    """The engine closed the connection (after whatever it still had to say)."""
    with contextlib.suppress(ConnectionError):
        while await asyncio.wait_for(reader.read(1 << 16), timeout):
            pass
    return True


async def close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()


@dataclass
class Hello:
    """A hand-made client after its hello: the streams and every message the engine answered with."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    replies: list[dict[str, Any]]
    session_key: bytes | None = None
    """The link's session key once the hello was proved (what data-plane tokens derive from)."""

    @property
    def welcomed(self) -> bool:
        return self.replies[-1]["op"] == "welcome"

    @property
    def last(self) -> dict[str, Any]:
        return self.replies[-1]

    async def send(self, *objs: object) -> None:
        self.writer.write(b"".join(frame(o) for o in objs))
        await self.writer.drain()

    async def close(self) -> None:
        await close(self.writer)


async def hello(
    address: str,
    key: str,
    *,
    incarnation: int = 1,
    backend: str = "mock",
    secret: bytes | None = ENV_SECRET,
    auth: bool | None = None,
    bad_proof: bool = False,
    prove: bool = True,
    source: str | None = None,
) -> Hello:
    """Say hello as engine ``key``: with ``secret``, answer the challenge with a proof (a wrong one if
    ``bad_proof``, none unless ``prove``); ``auth`` overrides what the hello claims. Stops at the first
    refusal. ``source``: the local address to connect from."""
    reader, writer = await open_raw(address, source)
    nonce = os.urandom(32)
    claims = secret is not None if auth is None else auth
    msg: dict[str, Any] = {"op": "hello", "id": 1, "engine": engine_fields(key, backend, incarnation)}
    if claims:
        msg |= {"auth": True, "nonce": b64(nonce)}
    writer.write(frame(msg))
    await writer.drain()
    replies = [await read_message(reader)]
    if replies[0]["op"] != "challenge" or not prove:
        return Hello(reader, writer, replies)
    challenge = replies[0]
    listener = challenge["engine"]
    transcript = Transcript(
        key, incarnation, nonce, listener["key"], listener["incarnation"], base64.b64decode(challenge["nonce"]),
        proven_transports(msg["engine"], listener),
    )  # fmt: skip
    proof = transcript.proof(secret or os.urandom(32), "dialer")
    if bad_proof:
        proof = bytes([proof[0] ^ 1]) + proof[1:]
    writer.write(frame({"op": "proof", "id": 2, "proof": b64(proof)}))
    await writer.drain()
    replies.append(await read_message(reader))
    return Hello(reader, writer, replies, transcript.session_key(secret) if secret is not None else None)


async def until(condition: Any, limit: float = 5.0) -> None:
    """Poll an engine's statistics until ``condition()`` holds (the engine acts on its own tasks)."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + limit
    while not condition():
        assert loop.time() < give_up, "the engine did not get there in time"
        await asyncio.sleep(0.005)
