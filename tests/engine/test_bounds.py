"""What a peer can make an engine hold is bounded, over real sockets (issue 8's attacks, by hand).

Each limit is an ``IOEngineConfig`` field; the tests set it low, go past it
with a hand-written client, and check the refusal or close, the counters,
the log (one line per address, no traceback), that everything returns to its
baseline once the client leaves, and that a legitimate peer keeps working.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from moriio_async import ControlPlaneError, IOEngine, IOEngineConfig, PeerError, waiting_for_transfer_complete
from moriio_async.control.listener import Listener

from ..control.watch import listening_fds, still_watched
from ..control.wire import close, closed_by_peer, engine_fields, frame, hello, open_raw, read_message, until
from .conftest import Pair, make_pair


@pytest.fixture
async def tight(backend: str, request: pytest.FixtureRequest) -> AsyncIterator[Pair]:
    """A pair (session a -> b) whose engines take the limits the test's ``limits`` marker names."""
    marker = request.node.get_closest_marker("limits")
    a, b, p = await make_pair(backend, **(marker.kwargs if marker else {}))
    try:
        yield p
    finally:
        await a.close()
        await b.close()


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "moriio_async" and r.levelno >= logging.WARNING]


def no_tracebacks(caplog: pytest.LogCaptureFixture) -> bool:
    return not any(r.exc_info for r in caplog.records)


async def still_works(p: Pair) -> None:
    p.buf_b[:64] = 0x33
    await waiting_for_transfer_complete([p.session.read(0, 0, 64)], timeout=10)
    assert (p.buf_a[:64] == 0x33).all()
    await p.a.notify("b", b"still here")
    assert (await p.b.recv_notification(timeout=5)).data == b"still here"


@pytest.mark.limits(max_links_per_address=4, max_links=100)
async def test_links_per_address_are_capped_at_accept_with_one_line(
    tight: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    b = tight.b
    held = [await hello(b.address, f"h{i}") for i in range(4 - b.statistics().peers.links)]
    assert all(h.welcomed for h in held)
    caplog.clear()
    for _ in range(20):
        reader, writer = await open_raw(b.address)
        refusal = await read_message(reader)
        assert (refusal["op"], refusal["reason"]) == ("error", "busy")
        assert "max_links_per_address" in refusal["message"]
        assert await closed_by_peer(reader)
        await close(writer)
    assert b.statistics().guard.refused_links == 20
    assert len(warnings(caplog)) == 1 and "127.0.0.1" in warnings(caplog)[0]
    async with IOEngine("late", IOEngineConfig(backend=tight.a.backend_name)) as late:
        with pytest.raises(PeerError, match="max_links_per_address"):  # the refusal's reason, not a timeout
            await late.connect(b.address)
        for h in held:
            await h.close()
        await until(lambda: b.statistics().peers.links <= 1)
        assert (await late.connect(b.address)).engine.key == "b"
    await still_works(tight)


@pytest.mark.limits(max_links=3)
async def test_accepted_links_are_capped_in_all(tight: Pair) -> None:
    b = tight.b
    held = [await hello(b.address, f"h{i}") for i in range(3 - b.statistics().peers.links)]
    reader, writer = await open_raw(b.address)
    refusal = await read_message(reader)
    assert refusal["reason"] == "busy" and "max_links" in refusal["message"]
    await close(writer)
    for h in held:
        await h.close()
    await until(lambda: b.statistics().peers.links == 1)
    await still_works(tight)


@pytest.mark.limits(max_links=1200, max_links_per_address=1200, link_idle_timeout=5.0)
async def test_a_thousand_idle_links_within_the_caps_are_closed_after_the_idle_timeout(tight: Pair) -> None:
    """Issue 8: ~1,000 idle links exhausted a 1,024-fd limit and legitimate handshakes timed out. Here the
    caps admit them, a legitimate peer connects and transfers meanwhile, and every idle link is closed
    after link_idle_timeout, while the link that carries the session's answering pair stays."""
    b = tight.b
    baseline = b.statistics()
    clients = []
    for batch in range(10):  # a hundred at a time: the listen backlog is 128
        clients += await asyncio.gather(*(hello(b.address, f"idle{batch}-{i}") for i in range(100)))
    assert all(c.welcomed for c in clients)
    assert b.statistics().peers.links == baseline.peers.links + 1000
    async with IOEngine("legit", IOEngineConfig(backend=tight.a.backend_name)) as legit:
        assert (await legit.connect(b.address)).engine.key == "b"
    await still_works(tight)
    await until(lambda: b.statistics().peers.links == baseline.peers.links, limit=20)
    assert b.statistics().guard.idle_closed >= 1000
    assert b.statistics().guard.refused_links == 0
    assert all([await closed_by_peer(c.reader) for c in clients])
    for c in clients:
        await c.close()
    assert b.statistics().peers.answering_qps == baseline.peers.answering_qps
    await still_works(tight)  # the session's link was never idle-closed: no reconnect needed


@pytest.mark.parametrize("secret", ["", "a-secret-for-the-idle-redial-test"])
async def test_a_dialer_closes_its_idle_link_first_and_redials_when_needed(backend: str, secret: str) -> None:
    cfg = IOEngineConfig(backend=backend, link_idle_timeout=0.6, secret=secret)
    async with IOEngine("b", cfg) as b, IOEngine("a", cfg) as a:
        await a.connect(b.address)
        await until(lambda: a.statistics().peers.links == 0 and b.statistics().peers.links == 0)
        assert a.statistics().guard.idle_closed == 1  # the dialer's own close, at half the timeout
        assert b.statistics().guard.idle_closed == 0  # so the listener never had to
        await a.notify("b", b"after the idle close")  # dials (and proves) again
        assert (await b.recv_notification(timeout=5)).data == b"after the idle close"
        assert b.statistics().guard.auth_failures == 0


async def test_a_pair_opened_over_an_accepted_link_keeps_it_open_until_that_pair_closes(backend: str) -> None:
    """b opens its session over the link a dialed (a never idle-closes it: its timeout is long). While the
    pair is open, b never closes that link as idle; once b closes the session, it carries nothing and b
    closes it after its idle timeout."""
    async with (
        IOEngine("b", IOEngineConfig(backend=backend, link_idle_timeout=0.6)) as b,
        IOEngine("a", IOEngineConfig(backend=backend)) as a,
    ):
        source = np.full(64, 0x5A, np.uint8)
        dest = np.zeros(64, np.uint8)
        await a.connect(b.address)
        session = await b.create_session(b.register_memory(dest), a.register_memory(source, name="kv"))
        await asyncio.sleep(1.0)  # past b's idle timeout, with only the pair on the link
        assert b.statistics().guard.idle_closed == 0 and b.statistics().peers.links == 1
        await waiting_for_transfer_complete([session.read(0, 0, 64)], timeout=10)
        assert (dest == 0x5A).all()
        await session.close()
        await until(lambda: b.statistics().guard.idle_closed == 1 and b.statistics().peers.links == 0)


@pytest.mark.limits(max_notifications=8, control_timeout=1.0)
async def test_a_notification_flood_pushes_back_on_the_sender(tight: Pair) -> None:
    """Issue 8: the notification queue was unbounded (+110 MB). It holds max_notifications; then the
    link stops reading, TCP pushes back, and the flooding sender's notify fails after its timeout."""
    a, b = tight.a, tight.b
    payload = b"x" * (256 << 10)
    sent = 0
    with pytest.raises(ControlPlaneError, match="failed"):
        for _ in range(10_000):
            await a.notify("b", payload)
            sent += 1
            assert b.statistics().inbound.notifications <= 8
    assert 8 <= sent < 10_000
    assert b.statistics().inbound.notifications == 8
    got = [await b.recv_notification(timeout=5) for _ in range(8)]
    assert all(n.data == payload for n in got)


@pytest.mark.limits(max_notifications=16)
async def test_a_hostile_notification_flood_is_held_to_the_limit(tight: Pair) -> None:
    b = tight.b
    said = await hello(b.address, "flood")
    flood = frame({"op": "notify", "data": "aGk="}) * 2000
    said.writer.write(flood)  # no drain: the engine stops reading once its inbox is full
    await until(lambda: b.statistics().inbound.notifications == 16)
    await asyncio.sleep(0.1)
    assert b.statistics().inbound.notifications == 16
    said.writer.transport.abort()
    # The application takes what was accepted; the link then reads on, finds the end, and goes.
    taken = 0
    while b.statistics().peers.links > 1 or b.statistics().inbound.notifications:
        note = await b.recv_notification(timeout=5)
        assert note.peer == "flood"
        taken += 1
    assert taken <= 2000


@pytest.mark.limits(max_answering_qps_per_link=16)
async def test_answering_pairs_per_link_are_capped(tight: Pair, backend: str) -> None:
    """Issue 8: 2,000 answering queue pairs from one link. Past the limit connect_qp is refused with a
    reason; closing one makes room; the pairs go when the link does."""
    b = tight.b
    baseline = b.statistics().peers.answering_qps
    said = await hello(b.address, "pairs", backend=backend)
    endpoint = {"backend": backend, "accepting": False, "host": "127.0.0.1", "port": 1, "qp_num": 1}
    requests = [
        {"op": "connect_qp", "id": 10 + i, "incarnation": b.incarnation, "endpoint": endpoint | {"token": f"{i:032x}"}}
        for i in range(200)
    ]
    await said.send(*requests)
    replies = [await read_message(said.reader) for _ in requests]
    granted = [r for r in replies if r["op"] == "qp"]
    refused = [r for r in replies if r["op"] == "error"]
    assert len(granted) == 16 and len(refused) == 184
    why = "at most 16 answering queue pairs per link (max_answering_qps_per_link)"
    assert all(why in r["message"] for r in refused)
    assert b.statistics().peers.answering_qps == baseline + 16
    await said.send({"op": "close_qp", "qp": granted[0]["qp"]}, requests[0] | {"id": 999})
    assert (await read_message(said.reader))["op"] == "qp"
    await said.close()
    await until(lambda: b.statistics().peers.answering_qps == baseline)
    await still_works(tight)


@pytest.mark.limits(control_timeout=3.0)
async def test_connect_qp_naming_a_blackhole_cannot_block_a_legitimate_session(tight: Pair, backend: str) -> None:
    """Issue 8: connect_qp with accepting: true made the target dial an address the peer named from a
    default-executor worker; twelve such frames blocked a legitimate create_session for 10 s. The
    answering connects run on their own executor, one per link at a time, so a legitimate session is
    made while the hostile connects still hang."""
    b = tight.b
    baseline = b.statistics().peers.links
    blackhole = socket.create_server(("127.0.0.1", 0), backlog=64)  # connects complete; nothing ever answers
    try:
        said = await hello(b.address, "hostile", backend=backend)
        endpoint = {"backend": backend, "accepting": True, "host": "127.0.0.1", "qp_num": 1, "token": "cd" * 16,
                    "port": blackhole.getsockname()[1]}  # fmt: skip
        await said.send(*({"op": "connect_qp", "id": i, "incarnation": b.incarnation, "endpoint": endpoint}
                          for i in range(1, 13)))  # fmt: skip
        await asyncio.sleep(0.2)  # the first hostile connect is under way
        info = await tight.a.connect(b.address)
        session = await asyncio.wait_for(tight.a.create_session(tight.desc_a, info.memory["kv"]), 2.0)
        await waiting_for_transfer_complete([session.read(0, 0, 64)], timeout=5)
        await session.close()
        await said.close()
    finally:
        blackhole.close()
    await until(lambda: b.statistics().peers.links == baseline + 1, limit=10)  # a's second link stays
    await still_works(tight)


async def test_deeply_nested_frames_from_many_connections_leave_nothing(
    pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 8: a deeply nested first frame raised RecursionError that nothing caught: 1,000 frames kept
    1,000 links, each logged a traceback. Now each is a bad frame: refused, closed, counted, one line."""
    b = pair.b
    baseline = b.statistics()
    caplog.clear()
    nested = b'{"op":"hello","x":' + b"[" * 50_000 + b"]" * 50_000 + b"}"

    async def one(after_hello: bool) -> None:
        if after_hello:
            said = await hello(b.address, "nest")
            reader, writer = said.reader, said.writer
        else:
            reader, writer = await open_raw(b.address)
        writer.write(struct.pack("!I", len(nested)) + nested)
        await writer.drain()
        reply = await read_message(reader)
        assert reply["op"] == "error" and reply["reason"] in ("handshake", "frame")
        assert await closed_by_peer(reader)
        await close(writer)

    for _ in range(40):  # 25 at a time: within max_links_per_address
        await asyncio.gather(*(one(after_hello=bool(i % 2)) for i in range(25)))
    await until(lambda: b.statistics().peers.links == baseline.peers.links)
    stats = b.statistics()
    assert stats.guard.bad_frames + stats.guard.rogue_hellos - baseline.guard.rogue_hellos >= 1000
    assert len(warnings(caplog)) <= 2  # one per kind (hello refused, bad frame) per address per interval
    assert no_tracebacks(caplog)
    await still_works(pair)


@pytest.mark.parametrize("qp", ["seven", None, -1, 2**40, [1], {"x": 1}, 1.5])
async def test_close_qp_with_a_bad_field_is_one_line_and_no_traceback(
    pair: Pair, qp: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 8: a close_qp with a non-integer field logged a full traceback per 40-byte frame."""
    b = pair.b
    baseline = b.statistics()
    caplog.clear()
    for _ in range(50):
        said = await hello(b.address, "closer")
        await said.send({"op": "close_qp", "qp": qp})
        reply = await read_message(said.reader)
        assert (reply["op"], reply["reason"]) == ("error", "frame")
        await said.close()
    await until(lambda: b.statistics().peers.links == baseline.peers.links)
    assert b.statistics().guard.bad_frames == baseline.guard.bad_frames + 50
    assert len(warnings(caplog)) == 1
    assert no_tracebacks(caplog)
    assert b.statistics().peers.answering_qps == baseline.peers.answering_qps


@pytest.mark.limits(max_key=64, max_peers=4)
async def test_long_keys_are_refused_and_forgotten_peers_are_pruned(tight: Pair) -> None:
    """Issue 8: 100 hellos with 900 KB keys kept +90 MB after every link closed. Keys beyond max_key are
    refused; peers without a link are remembered up to max_peers, least recently used forgotten first."""
    b = tight.b
    said = await hello(b.address, "k" * 65)
    assert (said.last["op"], said.last["reason"]) == ("error", "handshake")
    assert "exceeds 64" in said.last["message"]
    await said.close()
    reader, writer = await open_raw(b.address)  # 900 KB: over the protocol's own ceiling of 1024
    writer.write(frame({"op": "hello", "id": 1, "engine": engine_fields("k" * 900_000)}))
    assert (await read_message(reader))["reason"] == "handshake"
    await close(writer)
    for i in range(100):
        said = await hello(b.address, f"peer-{i}")
        assert said.welcomed
        await said.close()
    await until(lambda: b.statistics().peers.links == 1)
    assert b.statistics().peers.peers <= 4
    await b.notify("a", b"a is never pruned while its link is open")
    assert (await tight.a.recv_notification(timeout=5)).peer == "b"


async def test_a_trickled_message_has_one_deadline_not_one_per_byte(backend: str) -> None:
    """Issue 8: every byte reset the read timeout (a 28-byte hello kept a thread 32 s). One message, one
    deadline, however slowly its bytes come: before the hello and after it."""
    async with IOEngine("b", IOEngineConfig(backend=backend, control_timeout=0.5)) as b:
        for after_hello in (False, True):
            if after_hello:
                said = await hello(b.address, "slow")
                reader, writer = said.reader, said.writer
            else:
                reader, writer = await open_raw(b.address)

            trickling = asyncio.get_running_loop().create_task(trickle(writer, frame({"op": "memory", "id": 5})))
            try:
                reply = await read_message(reader)
                assert not trickling.done(), "the engine waited for the whole trickle"
                assert reply["op"] == "error" and "within 0.5s" in reply["message"]
                assert await closed_by_peer(reader)
            finally:
                trickling.cancel()
                await close(writer)
        await until(lambda: b.statistics().peers.links == 0)


async def trickle(writer: asyncio.StreamWriter, data: bytes) -> None:
    for byte in data:  # one byte every 0.1 s
        writer.write(bytes([byte]))
        await asyncio.sleep(0.1)


async def test_the_listener_knows_whether_it_is_reachable_beyond_this_host() -> None:
    refuse_all = Listener(lambda r, w: None, admit=lambda host, pending_host, pending: "not in this test")
    port = await refuse_all.start("0.0.0.0", 0)
    fds = listening_fds(port)
    try:
        assert not refuse_all.loopback_only
    finally:
        await refuse_all.close()
    assert still_watched(fds) == []  # the next listener's socket takes the same fd
    local = Listener(lambda r, w: None)
    await local.start("127.0.0.1", 0)
    try:
        assert local.loopback_only
    finally:
        await local.close()
