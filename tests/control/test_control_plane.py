"""The control plane survives malformed, oversized, slow and hostile peers."""

from __future__ import annotations

import asyncio
import logging
import struct
from typing import Any

import pytest

from moriio_async import (
    ControlPlaneError,
    EngineClosed,
    IOEngine,
    IOEngineConfig,
    PeerError,
    StalePeer,
    waiting_for_transfer_complete,
)
from moriio_async.backends.base import Endpoint
from moriio_async.backends.mock.qp import MockQueuePair
from moriio_async.control.link import ControlLink
from moriio_async.core.framing import FrameError
from moriio_async.core.protocol import Notice, Reply, Request

from ..engine.conftest import Pair, make_pair
from .wire import close, engine_fields, frame, hello, messages, open_raw, read_message, until


async def raw_exchange(address: str, payload: bytes, *, read: bool = True) -> bytes:
    reader, writer = await open_raw(address)
    try:
        writer.write(payload)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 5) if read else b""
    finally:
        await close(writer)


def error_reason(reply: bytes) -> str:
    msg = messages(reply)[-1]
    assert msg["op"] == "error"
    return str(msg["reason"])


async def raw_hello(address: str, key: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A hand-made client that said hello (and proved the secret, if this run has one) and was welcomed."""
    said = await hello(address, key)
    assert said.welcomed, said.replies
    return said.reader, said.writer


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\xff\xff\xff\xff garbage", "handshake"),  # oversized length
        (struct.pack("!I", 5) + b"nope!", "handshake"),  # not JSON
        (frame({"op": "connect_qp", "id": 1}), "handshake"),  # no hello first
        (frame({"op": "hello", "id": 1, "engine": {"key": 3}}), "handshake"),  # bad descriptor
        (frame({"op": "hello", "id": 1, "engine": 1}), "handshake"),  # not a descriptor at all
        (frame({"op": "hello", "id": 1, "engine": engine_fields("k" * 2000)}), "handshake"),  # key too long
        (struct.pack("!I", 200_001) + b'{"op":"hello","x":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "handshake"),
    ],
    ids=["oversized", "not-json", "no-hello", "bad-descriptor", "engine-not-object", "long-key", "deep-nesting"],
)
async def test_bad_first_frames_get_an_error_and_the_listener_keeps_serving(
    pair: Pair, payload: bytes, reason: str
) -> None:
    links = pair.b.statistics().peers.links
    reply = await raw_exchange(pair.b.address, payload)
    assert error_reason(reply) == reason
    await until(lambda: pair.b.statistics().peers.links == links)
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
    said = await hello(pair.b.address, "evil")
    assert said.welcomed
    said.writer.write(struct.pack("!I", 3) + b"]]]")
    await said.writer.drain()
    reply = await asyncio.wait_for(said.reader.read(), 5)
    assert [m["op"] for m in messages(reply)] == ["error"]
    assert error_reason(reply) == "frame"
    await said.close()
    # The established link between a and b still works.
    await pair.a.notify("b", b"still here")
    assert (await pair.b.recv_notification(timeout=5)).data == b"still here"


@pytest.mark.parametrize(
    "bad",
    [
        {"op": "launch_missiles", "id": 2},
        {"op": "notify", "data": "!!!"},
        {"op": "close_qp", "qp": "seven"},
        {"op": "connect_qp", "id": 2, "incarnation": 1, "endpoint": {"deep": [[[]]]}},
        b'{"op": "memory", "id": 2, "x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    ],
    ids=["unknown-op", "bad-base64", "qp-not-int", "nested-endpoint", "deep-nesting"],
)
async def test_a_message_that_does_not_validate_closes_only_its_link_with_one_warning(
    pair: Pair, bad: dict[str, Any] | bytes, caplog: pytest.LogCaptureFixture
) -> None:
    links = pair.b.statistics().peers.links
    reader, writer = await raw_hello(pair.b.address, "evil")
    caplog.clear()
    writer.write(struct.pack("!I", len(bad)) + bad if isinstance(bad, bytes) else frame(bad))
    await writer.drain()
    reply = await read_message(reader)
    assert (reply["op"], reply["reason"], reply["re"]) == ("error", "frame", None)
    assert await asyncio.wait_for(reader.read(), 5) == b""  # and the link was closed
    writer.close()
    await until(lambda: pair.b.statistics().peers.links == links)
    assert [r.levelno for r in caplog.records if r.name == "moriio_async"] == [logging.WARNING]
    assert not any(r.exc_info for r in caplog.records), "a bad frame logged a traceback"
    await pair.a.notify("b", b"still here")
    assert (await pair.b.recv_notification(timeout=5)).data == b"still here"


async def test_a_refused_request_gets_its_reason_and_keeps_the_link(pair: Pair) -> None:
    """Each refused connect_qp says why (the incarnation it is, a connect that failed and how), and the
    link serves the next request."""
    reader, writer = await raw_hello(pair.b.address, "evil")
    answering = pair.b.statistics().peers.answering_qps
    try:
        endpoint = {"backend": "mock", "token": "t"}
        writer.write(frame({"op": "connect_qp", "id": 2, "incarnation": pair.b.incarnation ^ 1, "endpoint": endpoint}))
        reply = await read_message(reader)
        assert (reply["op"], reply["re"], reply["reason"]) == ("error", 2, "stale")
        said = f"is incarnation {pair.b.incarnation:#x}, not {pair.b.incarnation ^ 1:#x}: it restarted"
        assert said in reply["message"], reply["message"]
        nobody = {"backend": pair.b.backend_name, "accepting": True, "host": "127.0.0.1", "port": 1, "qp_num": 1,
                  "token": "zz"}  # fmt: skip
        writer.write(frame({"op": "connect_qp", "id": 5, "incarnation": pair.b.incarnation, "endpoint": nobody}))
        reply = await read_message(reader)
        assert (reply["op"], reply["re"], reply["reason"]) == ("error", 5, "refused")
        assert reply["message"].startswith("cannot connect the answering queue pair: "), reply["message"]
        assert pair.b.statistics().peers.answering_qps == answering  # the pair that failed to connect is gone
        writer.write(frame({"op": "memory", "id": 3}))
        reply = await read_message(reader)
        assert (reply["op"], reply["re"]) == ("exports", 3)
        assert [m["name"] for m in reply["memory"]] == ["kv"]
        writer.write(frame({"op": "hello", "id": 4, "engine": engine_fields("evil")}))
        reply = await read_message(reader)
        assert (reply["op"], reply["re"], reply["reason"]) == ("error", 4, "refused")
    finally:
        writer.close()


async def test_closing_a_session_closes_the_answering_pair_it_had_on_the_peer(pair: Pair) -> None:
    """close_qp used to name the initiator's own queue pair, which the target does not know:
    the answering pair stayed until the whole link closed."""
    answering = pair.b.statistics().peers.answering_qps
    info = await pair.a.connect(pair.b.address)
    session = await pair.a.create_session(pair.desc_a, info.memory["kv"])
    assert pair.b.statistics().peers.answering_qps == answering + 1
    assert pair.a.statistics().peers.opened_qps == 2
    await session.close()
    await until(lambda: pair.b.statistics().peers.answering_qps == answering)
    assert pair.a.statistics().peers.opened_qps == 1
    await waiting_for_transfer_complete(pair.session.read(0, 0, 64), timeout=10)  # the other session is intact


async def test_a_session_pair_that_fails_to_connect_has_the_peer_close_its_answering_half(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """b answered a's connect_qp, then a's own connect fails (the mock's queue pair refuses to dial): a
    tells b to close the answering pair it made (close_qp), so none is left on b for a pair that never comes."""
    a, b, pair = await make_pair("mock")
    try:
        answering = b.statistics().peers.answering_qps
        real = MockQueuePair.connect

        def refuse_to_dial(qp: MockQueuePair, remote: Endpoint) -> None:
            if remote.get("accepting"):  # the opening side dials the answering half: that one fails
                raise PeerError("refused by the test")
            real(qp, remote)

        monkeypatch.setattr(MockQueuePair, "connect", refuse_to_dial)
        info = await a.connect(b.address)
        with pytest.raises(PeerError):
            await a.create_session(pair.desc_a, info.memory["kv"])
        monkeypatch.setattr(MockQueuePair, "connect", real)
        await until(lambda: b.statistics().peers.answering_qps == answering)
        assert a.statistics().peers.opened_qps == 1  # the first session's
        await waiting_for_transfer_complete(pair.session.read(0, 0, 64), timeout=10)
    finally:
        await a.close()
        await b.close()


async def test_a_new_incarnations_hello_closes_every_answering_pair_of_the_old_one_and_its_own_work(
    pair: Pair,
) -> None:
    """b answers a pair for a's session; another engine under key "a" (a restart) says hello: the old
    incarnation's pair and links close, and the new one's session gets a pair of its own that works."""
    assert pair.b.statistics().peers.answering_qps == 1
    async with IOEngine("a", IOEngineConfig(backend=pair.a.backend_name)) as a2:
        desc = a2.register_memory(bytearray(64))
        peer = await a2.connect(pair.b.address)
        assert pair.b.statistics().peers.answering_qps == 0  # the old incarnation's, closed with its hello
        await until(lambda: not pair.session.alive())
        session = await a2.create_session(desc, peer.memory["kv"])
        await waiting_for_transfer_complete(session.read(0, 0, 64), timeout=10)
        assert pair.b.statistics().peers.answering_qps == 1
        await session.close()


async def test_a_new_incarnations_hello_leaves_the_links_and_pairs_of_other_engines_open(pair: Pair) -> None:
    """A restart of "a" supersedes a's links on b, not those of "c", an engine of another key with a
    session to b: c's link stays open and its pair keeps answering."""
    backend = pair.a.backend_name
    async with IOEngine("c", IOEngineConfig(backend=backend)) as c:
        desc_c = c.register_memory(buf_c := bytearray(64))
        peer = await c.connect(pair.b.address)
        session_c = await c.create_session(desc_c, peer.memory["kv"])
        await waiting_for_transfer_complete(session_c.read(0, 0, 64), timeout=10)
        assert pair.b.statistics().peers.answering_qps == 2
        async with IOEngine("a", IOEngineConfig(backend=backend)) as a2:
            await a2.connect(pair.b.address)
            await until(lambda: not pair.session.alive())  # a's old incarnation: superseded
            assert pair.b.statistics().peers.answering_qps == 1  # c's
            assert session_c.alive()
            pair.buf_b[:64] = 0x3C
            await waiting_for_transfer_complete(session_c.read(0, 0, 64), timeout=10)
            assert bytes(buf_c) == b"\x3c" * 64
            assert c.statistics().peers.opened_qps == 1
        await session_c.close()


async def test_another_peers_close_qp_naming_a_s_answering_pairs_closes_nothing_of_a_s(
    pair: Pair, backend: str
) -> None:
    """A third engine on its own link names every answering pair number near its own in close_qp: only
    the engine that asked for a pair may close it, so a's pair on b (made just before) stays. The third
    engine says hello at a's incarnation number: an engine is its key and its incarnation, not either."""
    b = pair.b
    evil = await hello(b.address, "evil", backend=backend, incarnation=pair.a.incarnation)
    try:
        assert evil.welcomed
        endpoint = {"backend": backend, "accepting": False, "host": "127.0.0.1", "port": 1, "qp_num": 1,
                    "token": "ab" * 16}  # fmt: skip
        await evil.send({"op": "connect_qp", "id": 2, "incarnation": b.incarnation, "endpoint": endpoint})
        own = await read_message(evil.reader)
        assert own["op"] == "qp"
        answering = b.statistics().peers.answering_qps  # a's, and evil's own
        numbers = [n for n in range(max(0, own["qp"] - 256), own["qp"] + 256) if n != own["qp"]]
        await evil.send(*({"op": "close_qp", "qp": n} for n in numbers), {"op": "memory", "id": 3})
        while (await read_message(evil.reader)).get("re") != 3:  # notices first: they were handled
            pass
        assert b.statistics().peers.answering_qps == answering
        pair.buf_b[:64] = 0x5A
        await waiting_for_transfer_complete(pair.session.read(0, 0, 64), timeout=10)  # a's pair still answers
        assert (pair.buf_a[:64] == 0x5A).all()
        await evil.send({"op": "close_qp", "qp": own["qp"]})  # its own: that one it may close
        await until(lambda: b.statistics().peers.answering_qps == answering - 1)
    finally:
        await evil.close()


async def test_notifications_end_with_the_engine(backend: str) -> None:
    async with IOEngine("b", IOEngineConfig(backend=backend)) as b, IOEngine("a", IOEngineConfig(backend=backend)) as a:
        await a.connect(b.address)
        await a.notify("b", b"one")
        await a.notify("b", b"two")
        await until(lambda: b.statistics().inbound.notifications == 2)
        seen: list[bytes] = []

        async def consume() -> None:
            async for note in b.notifications():
                seen.append(note.data)

        consumer = asyncio.get_running_loop().create_task(consume())
        waiter = asyncio.get_running_loop().create_task(b.recv_notification())
        await until(lambda: seen == [b"one", b"two"])
        await b.close()
        await asyncio.wait_for(consumer, 5)  # the iteration ended instead of waiting forever
        with pytest.raises(EngineClosed):
            await asyncio.wait_for(waiter, 5)
        with pytest.raises(EngineClosed):
            await b.recv_notification(timeout=5)


async def test_connect_to_nothing_fails_cleanly() -> None:
    async with IOEngine("a", IOEngineConfig(backend="mock", control_timeout=1)) as a:
        with pytest.raises(Exception, match="cannot reach engine"):
            await a.connect("127.0.0.1:1")


class Refusing:
    """A link handler whose every request fails with one exception."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    async def on_request(self, link: ControlLink, request: Request) -> Reply:
        raise self.exc

    async def on_notice(self, link: ControlLink, notice: Notice) -> None:
        pass

    def on_bad_frame(self, link: ControlLink, error: FrameError) -> None:
        pass

    def on_link_closed(self, link: ControlLink) -> None:
        pass


@pytest.mark.parametrize(
    ("exc", "reason", "logged"),
    [
        (EngineClosed("engine 'b' is closing"), "closed", []),
        (StalePeer("engine 'b' restarted"), "stale", []),
        (ControlPlaneError("no such pair"), "refused", []),
        (RuntimeError("a bug"), "internal", [logging.ERROR]),
    ],
    ids=["engine-closed", "stale", "refused", "bug"],
)
async def test_a_refusal_is_answered_with_its_reason_and_only_a_bug_is_logged(
    exc: Exception, reason: str, logged: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    """EngineClosed (a connect_qp that reaches an engine while it closes) used to be logged as an
    internal error with a traceback; it is a refusal like any other."""
    links: list[ControlLink] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = ControlLink(reader, writer, Refusing(exc), max_frame=1 << 16, timeout=5)
        links.append(link)
        link.start()

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    host, port = server.sockets[0].getsockname()[:2]
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(frame({"op": "memory", "id": 5}))
        # Bounded: a handler exception that escaped the request task would leave this unanswered.
        reply = await asyncio.wait_for(read_message(reader), 5)
        assert (reply["op"], reply["re"], reply["reason"]) == ("error", 5, reason)
        assert [r.levelno for r in caplog.records if r.name == "moriio_async"] == logged
        with pytest.raises(RuntimeError, match="already started"):
            links[0].start()  # a second reader would split the stream between two tasks
    finally:
        writer.close()
        for link in links:
            link.close()
            await link.wait_closed()
        server.close()
        await server.wait_closed()


async def test_a_session_being_created_when_its_engine_closes_leaves_no_queue_pair(pair: Pair) -> None:
    info = await pair.a.connect(pair.b.address)
    creating = asyncio.get_running_loop().create_task(pair.a.create_session(pair.desc_a, info.memory["kv"]))
    await asyncio.sleep(0)  # the request for an answering pair is on its way
    await pair.a.close()
    with pytest.raises((ControlPlaneError, EngineClosed)):
        await creating
    stats = pair.a.statistics()
    assert (stats.sessions, stats.peers.opened_qps, stats.router.channels) == (0, 0, 0)
    await until(lambda: pair.b.statistics().peers.answering_qps == 0)


async def test_a_redial_that_reaches_another_engine_is_refused(backend: str) -> None:
    """A peer's address taken over by another engine: notify must not send to the newcomer."""
    async with IOEngine("a", IOEngineConfig(backend=backend)) as a:
        b = await IOEngine("b", IOEngineConfig(backend=backend)).start()
        await a.connect(b.address)
        port = int(b.address.rsplit(":", 1)[1])
        await b.close()
        await until(lambda: a.statistics().peers.links == 0)
        async with IOEngine("c", IOEngineConfig(backend=backend, port=port)) as c:
            with pytest.raises(ControlPlaneError, match="is engine 'c' now, not 'b'"):
                await a.notify("b", b"for b only")
            assert c.statistics().inbound.notifications == 0
