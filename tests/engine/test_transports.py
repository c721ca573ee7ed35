"""A transport per peer: which backend each session uses, chosen from both ends' hellos.

Two engines in one process share the host, so ``backend="auto"`` must pick cma; an engine with tcp
alone makes its peer pick tcp; an explicit ``backends`` order is each engine's own preference. The
hello's transports are covered by the proofs of an authenticated hello: a man in the middle who
rewrites them fails the hello.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
from collections.abc import AsyncIterator

import numpy as np
import pytest

from moriio_async import Access, IOEngine, IOEngineConfig, waiting_for_transfer_complete
from moriio_async.core.framing import FrameError
from moriio_async.core.protocol import decode
from moriio_async.descriptors import EngineDesc, MemoryDesc, TransportDesc
from moriio_async.errors import AuthenticationError, InvalidArgument

from ..control.wire import hello, read_message

SIZE = 1 << 20
SECRET = b"transports-are-covered-by-the-proof"


async def engines(*configs: IOEngineConfig) -> list[IOEngine]:
    return [await IOEngine(key, cfg).start() for key, cfg in zip("abcdef", configs, strict=False)]


@contextlib.asynccontextmanager
async def running(*configs: IOEngineConfig) -> AsyncIterator[list[IOEngine]]:
    started = await engines(*configs)
    try:
        yield started
    finally:
        for engine in started:
            await engine.close()


async def round_trip(a: IOEngine, b: IOEngine) -> str:
    """Read b's region into a's, then write it back inverted; check both; the session's transport."""
    src = np.random.default_rng(3).integers(0, 256, SIZE, dtype=np.uint8)
    dst = np.zeros(SIZE, np.uint8)
    desc_a = a.register_memory(dst, name="dst")
    b.register_memory(src, name="src")
    peer = await a.connect(b.address)
    session = await a.create_session(desc_a, peer.memory["src"])
    await waiting_for_transfer_complete([session.read(0, 0, SIZE)], timeout=10)
    assert np.array_equal(dst, src)
    expected = np.bitwise_not(src)
    np.copyto(dst, expected)
    await waiting_for_transfer_complete([session.batch_write([0, SIZE // 2], [0, SIZE // 2], [SIZE // 2] * 2)], 10)
    assert np.array_equal(src, expected)
    stats = session.statistics()
    assert stats.transport == session.transport
    assert f"over {session.transport}" in repr(session)
    assert a.statistics().peer_transports[b.key] == session.transport
    # The target knows it too: the pairs a opened to it run on that transport.
    assert b.statistics().answering_transports[a.key] == session.transport
    return session.transport


async def test_two_engines_on_one_host_choose_cma_by_themselves() -> None:
    async with running(IOEngineConfig(backend="auto"), IOEngineConfig(backend="auto")) as (a, b):
        assert a.transports[0] == "cma" and "tcp" in a.transports
        assert [t.name for t in a.get_engine_desc().transports] == list(a.transports)
        assert await round_trip(a, b) == "cma"
        assert await round_trip(b, a) == "cma"


async def test_a_peer_with_tcp_alone_is_reached_over_tcp() -> None:
    async with running(IOEngineConfig(backend="auto"), IOEngineConfig(backends=("tcp",))) as (a, b):
        assert b.transports == ("tcp",)
        assert await round_trip(a, b) == "tcp"
        assert await round_trip(b, a) == "tcp"


async def test_an_explicit_order_is_each_engines_own_preference() -> None:
    async with running(IOEngineConfig(backends=("tcp", "cma")), IOEngineConfig(backends=("cma", "tcp"))) as (a, b):
        assert await round_trip(a, b) == "tcp"
        assert await round_trip(b, a) == "cma"


async def test_no_transport_in_common_is_refused_with_both_lists() -> None:
    async with running(IOEngineConfig(backends=("cma",)), IOEngineConfig(backends=("tcp",))) as (a, b):
        b.register_memory(np.zeros(64, np.uint8), name="src")
        desc = a.register_memory(np.zeros(64, np.uint8))
        peer = await a.connect(b.address)
        with pytest.raises(Exception, match="shares no transport") as info:
            await a.create_session(desc, peer.memory["src"])
        assert "['cma']" in str(info.value) and "['tcp']" in str(info.value)


async def test_a_pair_asked_on_a_transport_the_target_lacks_is_refused() -> None:
    async with running(IOEngineConfig(backends=("tcp",), secret="")) as (b,):
        said = await hello(b.address, "asker", backend="cma", secret=None)
        assert said.welcomed, said.replies
        endpoint = {"backend": "cma", "accepting": False, "qp_num": 7}
        ask = {"op": "connect_qp", "id": 5, "incarnation": b.incarnation, "endpoint": endpoint, "transport": "cma"}
        await said.send(ask)
        reply = await read_message(said.reader)
        await said.close()
        assert reply["op"] == "error" and "no cma transport" in reply["message"], reply
        assert b.statistics().peers.answering_qps == 0


def test_backends_must_name_distinct_known_backends() -> None:
    for bad in (("tcp", "tcp"), ("tcp", "auto"), ("rdma",)):
        with pytest.raises(InvalidArgument):
            IOEngineConfig(backends=bad)
    with pytest.raises(InvalidArgument):
        IOEngineConfig(backends="tcp")  # type: ignore[arg-type]
    assert IOEngineConfig(backends=["cma", "tcp"]).backends == ("cma", "tcp")  # type: ignore[arg-type]


class TamperingProxy:
    """Forwards one connection to ``target``, rewriting ``old`` to ``new`` in the first frame the dialer sends."""

    def __init__(self, target: str, old: bytes, new: bytes) -> None:
        self.target = target
        self.old, self.new = old, new
        self.rewrote = False
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = self.target.rsplit(":", 1)
        self.writers.append(writer)
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        self.writers.append(up_writer)
        (length,) = struct.unpack("!I", await reader.readexactly(4))
        body = await reader.readexactly(length)
        assert len(self.old) == len(self.new)
        if self.old in body:
            body = body.replace(self.old, self.new)
            self.rewrote = True
        up_writer.write(struct.pack("!I", len(body)) + body)
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.get_running_loop().create_task(self._pipe(src, dst))
            self.tasks.add(task)

    @staticmethod
    async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await src.read(1 << 16):
                dst.write(data)
                await dst.drain()
        dst.close()

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for writer in self.writers:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        await self.server.wait_closed()


@pytest.mark.parametrize("tamper", [False, True])
async def test_transports_rewritten_between_the_engines_fail_the_authenticated_hello(tamper: bool) -> None:
    cfg = IOEngineConfig(backend="auto", secret=SECRET)
    async with running(cfg, cfg) as (a, b):
        # The dialer's hello says its transports; the proxy renames its cma in it (the same length,
        # so the frame stays well-formed): b would believe a has no cma, a that it offered one.
        proxy = TamperingProxy(b.address, b'"name":"cma"', b'"name":"xma"' if tamper else b'"name":"cma"')
        address = await proxy.start()
        try:
            if tamper:
                with pytest.raises(AuthenticationError, match="failed to prove"):
                    await a.connect(address)
            else:
                peer = await a.connect(address)
                assert peer.engine.key == "b"
            assert proxy.rewrote
        finally:
            await proxy.close()


def test_descriptors_carry_transports_and_rkeys_and_refuse_too_many() -> None:
    engine = EngineDesc("a", "127.0.0.1", 1, 2, "cma", (TransportDesc("cma", "boot/pid:1"), TransportDesc("tcp")))
    assert EngineDesc.unpack(engine.pack()) == engine
    assert engine.transport_names() == ("cma", "tcp")
    assert EngineDesc("a", "h", 1, 2, "tcp").transport_names() == ("tcp",)  # an older peer: its one backend
    region = MemoryDesc("a", 2, "kv", 4096, 64, 7, Access.all(), (("cma", 7), ("tcp", 9)))
    assert MemoryDesc.unpack(region.pack()) == region
    assert region.rkey_for("tcp") == 9 and region.rkey_for("verbs") == 7
    too_many = [{"name": f"b{i}", "scope": ""} for i in range(5)]
    with pytest.raises(InvalidArgument):
        EngineDesc.unpack(json.dumps({**json.loads(engine.pack()), "transports": too_many}))
    with pytest.raises(InvalidArgument):
        MemoryDesc.unpack(json.dumps({**json.loads(region.pack()), "rkeys": {"tcp": 1 << 32}}))
    hello = {"op": "hello", "id": 1, "engine": {**json.loads(engine.pack()), "transports": too_many}}
    with pytest.raises(FrameError):
        decode(json.dumps(hello).encode())
