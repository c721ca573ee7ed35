"""Authentication over real sockets: a process without the secret can neither list, read, write nor
impersonate, and one with it works as before. Hostile clients speak the wire by hand (``wire.py``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest

from moriio_async import (
    AuthenticationError,
    InvalidArgument,
    IOEngine,
    IOEngineConfig,
    waiting_for_transfer_complete,
)
from moriio_async.descriptors import new_incarnation

from ..control.wire import b64, close, closed_by_peer, engine_fields, frame, hello, open_raw, read_message, until
from .conftest import Pair, make_pair

SECRET = b"the-shared-secret-of-this-test-run"
OTHER = b"another-secret-nobody-shares-here"


@pytest.fixture
async def secured(backend: str) -> AsyncIterator[Pair]:
    """Engines a and b sharing SECRET, with a session from a to b."""
    a, b, p = await make_pair(backend, secret=SECRET)
    try:
        yield p
    finally:
        await a.close()
        await b.close()


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "moriio_async" and r.levelno >= logging.WARNING]


async def test_with_a_secret_everything_works_as_before(secured: Pair) -> None:
    p = secured
    assert p.a.statistics().authenticated and p.b.statistics().authenticated
    p.buf_b[:4096] = 7
    await waiting_for_transfer_complete([p.session.read(0, 0, 4096)], timeout=10)
    assert (p.buf_a[:4096] == 7).all()
    p.buf_a[4096:8192] = 9
    await waiting_for_transfer_complete([p.session.write(4096, 4096, 4096)], timeout=10)
    assert (p.buf_b[4096:8192] == 9).all()
    await p.a.notify("b", b"to b")
    await p.b.notify("a", b"to a")  # over the link a dialed and proved
    assert (await p.b.recv_notification(timeout=5)).data == b"to b"
    assert (await p.a.recv_notification(timeout=5)).data == b"to a"
    assert p.b.statistics().guard.rogue_hellos == 0


@pytest.mark.parametrize(
    "attempt",
    ["hello-without-auth", "bad-proof", "no-proof", "memory-first", "connect_qp-first", "memory-instead-of-proof"],
)
async def test_without_the_secret_a_client_can_neither_list_read_nor_write(
    secured: Pair, attempt: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every way in without the secret gets one refusal and a closed connection, never the region list
    (so no rkey or address to read or write with) and never an answering queue pair; nothing is kept."""
    b = secured.b
    before = b.statistics()
    caplog.clear()
    endpoint = {"backend": "tcp", "accepting": False, "host": "127.0.0.1", "port": 1, "qp_num": 1, "token": "ab" * 16}
    connect_qp = {"op": "connect_qp", "id": 1, "incarnation": b.incarnation, "endpoint": endpoint}
    if attempt in ("memory-first", "connect_qp-first"):
        reader, writer = await open_raw(b.address)
        writer.write(frame({"op": "memory", "id": 1} if attempt == "memory-first" else connect_qp))
        replies = [await read_message(reader)]
    elif attempt == "memory-instead-of-proof":
        said = await hello(b.address, "intruder", secret=None, auth=True, prove=False)  # cannot answer it
        assert said.last["op"] == "challenge"
        assert "memory" not in said.last, "the challenge must not list exported memory"
        await said.send({"op": "memory", "id": 2})
        reader, writer, replies = said.reader, said.writer, [*said.replies, await read_message(said.reader)]
    elif attempt == "no-proof":
        said = await hello(b.address, "intruder", secret=None, auth=True, prove=False)
        await said.close()  # walks away after the challenge
        await until(lambda: b.statistics().peers.links == before.peers.links)
        reader, writer, replies = said.reader, said.writer, said.replies
    else:
        secret = OTHER if attempt == "bad-proof" else None
        said = await hello(b.address, "intruder", secret=secret, auth=attempt == "bad-proof")
        reader, writer, replies = said.reader, said.writer, said.replies
    assert not any(m["op"] in ("welcome", "exports", "qp") for m in replies), replies
    if attempt != "no-proof":
        assert replies[-1]["op"] == "error"
        assert replies[-1]["reason"] == ("handshake" if attempt.endswith("-first") else "auth")
        assert await closed_by_peer(reader)
    writer.close()
    await until(lambda: b.statistics().peers.links == before.peers.links)
    after = b.statistics()
    assert (after.peers.peers, after.peers.answering_qps, after.inbound.notifications) == (
        before.peers.peers,
        before.peers.answering_qps,
        before.inbound.notifications,
    )
    assert after.guard.rogue_hellos == before.guard.rogue_hellos + 1
    assert after.guard.auth_failures == before.guard.auth_failures + (not attempt.endswith("-first"))
    lines = warnings(caplog)
    assert len(lines) == 1 and "127.0.0.1" in lines[0], lines
    assert not any(r.exc_info for r in caplog.records), "a refused hello logged a traceback"


async def test_an_engine_without_the_secret_or_with_another_one_cannot_connect(secured: Pair, backend: str) -> None:
    for secret in ("", OTHER):
        async with IOEngine("intruder", IOEngineConfig(backend=backend, secret=secret)) as intruder:
            with pytest.raises(AuthenticationError):
                await intruder.connect(secured.b.address)
            assert intruder.statistics().peers.peers == 0
    assert secured.b.statistics().peers.peers == 1


@pytest.mark.parametrize("side", ["dialer", "listener"])
async def test_a_secret_on_one_side_only_fails_the_hello_saying_so_on_both_sides(
    backend: str, side: str, caplog: pytest.LogCaptureFixture
) -> None:
    dialer_secret, listener_secret = (SECRET, "") if side == "dialer" else ("", SECRET)
    async with (
        IOEngine("listener", IOEngineConfig(backend=backend, secret=listener_secret)) as listener,
        IOEngine("dialer", IOEngineConfig(backend=backend, secret=dialer_secret)) as dialer,
    ):
        caplog.clear()
        with pytest.raises(AuthenticationError) as err:
            await dialer.connect(listener.address)
        said = "has no shared secret" if side == "dialer" else "accepts only peers that prove its shared secret"
        assert said in str(err.value)
        assert "MORIIO_ASYNC_SECRET" in str(err.value)  # the hint says how to make them agree
        assert [said in line for line in warnings(caplog)] == [True]  # the listener says it too, once
        assert listener.statistics().guard.auth_failures == 1
        assert (listener.statistics().peers.peers, dialer.statistics().peers.peers) == (0, 0)


async def test_impersonation_under_another_engines_key_changes_nothing(
    secured: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 8: a hello under a's key with a newer incarnation replaced a's descriptor, closed its
    answering pairs (failing its transfers), received the notifications meant for a and could inject
    some under a's name. Without the secret, none of that happens and the attempt is counted and logged."""
    p = secured
    before = p.b.statistics()
    caplog.clear()
    newer = p.a.incarnation + 1
    for how in ("no-auth", "bad-proof", "wrong-secret"):
        said = await hello(
            p.b.address,
            "a",
            incarnation=newer,
            secret=None if how == "no-auth" else SECRET if how == "bad-proof" else OTHER,
            auth=how != "no-auth",
            bad_proof=how == "bad-proof",
        )
        assert said.last["op"] == "error" and said.last["reason"] == "auth"
        # Whatever it sends next is never read as a's: the connection is closed.
        await said.send({"op": "notify", "data": "ZXZpbA=="})
        assert await closed_by_peer(said.reader)
        await said.close()
    await until(lambda: p.b.statistics().peers.links == before.peers.links)
    after = p.b.statistics()
    assert after.guard.impersonations == before.guard.impersonations + 3
    assert after.peers.answering_qps == before.peers.answering_qps, "a's answering pair was closed"
    assert after.inbound.notifications == 0, "the impostor's notification was delivered"
    # a's session still works, and b's notifications still reach a, and only a.
    await waiting_for_transfer_complete([p.session.read(0, 0, 4096)], timeout=10)
    await p.b.notify("a", b"for a")
    note = await p.a.recv_notification(timeout=5)
    assert (note.peer, note.data) == ("b", b"for a")
    lines = warnings(caplog)
    assert len(lines) == 1 and "impersonation" in lines[0] and "127.0.0.1" in lines[0], lines


@pytest.mark.parametrize("secret", [SECRET, b""], ids=["secret", "open"])
async def test_with_a_secret_an_older_incarnation_is_refused_and_a_newer_one_supersedes(
    backend: str, secret: bytes
) -> None:
    """With a secret, incarnations are ordered: a hello older than the one known for a key is refused
    ("stale"); a newer one takes its place and closes the earlier incarnation's links. Without one, any
    other incarnation takes its place (a hostile hello with a huge incarnation must not lock the real
    engine out for good)."""
    async with IOEngine("b", IOEngineConfig(backend=backend, secret=secret)) as b:
        as_b = secret or None
        first = await hello(b.address, "x", incarnation=1000, secret=as_b)
        assert first.welcomed
        older = await hello(b.address, "x", incarnation=999, secret=as_b)
        if secret:
            assert (older.last["op"], older.last["reason"]) == ("error", "stale")
            assert await closed_by_peer(older.reader)
            assert b.statistics().peers.links == 1
            newer = await hello(b.address, "x", incarnation=1001, secret=as_b)
        else:
            newer = older  # it superseded the first
        assert newer.welcomed
        assert await closed_by_peer(first.reader), "the superseded incarnation's link stayed open"
        await until(lambda: b.statistics().peers.links == 1)
        for said in (first, older, newer):
            await said.close()
        await until(lambda: b.statistics().peers.links == 0)


async def test_incarnations_grow_with_start_time() -> None:
    values = [new_incarnation() for _ in range(1000)]
    assert values == sorted(values) and len(set(values)) == len(values)
    assert all(0 < v < 2**63 for v in values)
    assert IOEngine("x").incarnation < IOEngine("x").incarnation


def test_the_secret_is_checked_hidden_and_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(InvalidArgument, match="at least 16"):
        IOEngineConfig(secret="short")
    with pytest.raises(InvalidArgument, match="bytes or str"):
        IOEngineConfig(secret=12345678901234567890)  # type: ignore[arg-type]
    cfg = IOEngineConfig(secret=SECRET)
    assert SECRET.decode() not in repr(cfg)
    monkeypatch.setenv("MORIIO_ASYNC_SECRET", "e" * 24)
    assert IOEngineConfig().resolved_secret() == b"e" * 24
    assert IOEngineConfig(secret="").resolved_secret() is None  # "" turns authentication off explicitly
    assert IOEngineConfig(secret=SECRET).resolved_secret() == SECRET
    monkeypatch.setenv("MORIIO_ASYNC_SECRET", "short")
    with pytest.raises(InvalidArgument, match="at least 16"):
        IOEngine("x")


async def test_the_engine_says_at_start_whether_it_authenticates(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="moriio_async")
    async with IOEngine("open", IOEngineConfig(backend="mock", secret="")):
        pass
    async with IOEngine("closed", IOEngineConfig(backend="mock", secret=SECRET)):
        pass
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "moriio_async"]
    assert any(lv == logging.INFO and m.startswith("engine open accepts unauthenticated peers") for lv, m in lines)
    assert any(m.startswith("engine closed: peers must prove the shared secret") for _, m in lines)
    assert not [m for lv, m in lines if lv >= logging.WARNING], "a loopback engine warned"


async def test_a_listener_that_does_not_authenticate_is_refused_by_a_dialer_that_does(backend: str) -> None:
    """A rogue listener answering an authenticating hello with a welcome (no proof) is not trusted."""

    async def rogue(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = await read_message(reader)
        welcome = {"op": "welcome", "re": first["id"], "engine": first["engine"] | {"key": "rogue"}, "memory": []}
        writer.write(frame(welcome))
        await writer.drain()
        await reader.read()
        writer.close()

    server = await asyncio.start_server(rogue, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with IOEngine("dialer", IOEngineConfig(backend=backend, secret=SECRET)) as dialer:
            with pytest.raises(AuthenticationError, match="did not authenticate"):
                await dialer.connect(f"127.0.0.1:{port}")
            assert dialer.statistics().peers.peers == 0
    finally:
        server.close()
        await server.wait_closed()


async def test_proof_guesses_past_the_budget_each_wait_and_one_mistake_costs_nothing(backend: str) -> None:
    """Issue 23: 1,848 proof guesses a second, unlimited. A failed proof is charged to its source; past
    max_failures_per_source each new connection from there waits a quarter of the hello deadline (a timer,
    not a sleep on the loop) before it is heard, so each guess costs that long. An honest peer from the same
    address is delayed, not refused; one that got its proof wrong once is not delayed at all."""
    cfg = IOEngineConfig(backend=backend, secret=SECRET, max_failures_per_source=5, hello_timeout=0.8)
    async with IOEngine("b", cfg) as b, IOEngine("a", cfg) as a:
        for _ in range(15):
            said = await hello(b.address, "guesser", secret=SECRET, bad_proof=True, source="127.0.0.2")
            assert (said.replies[0]["op"], said.last["op"], said.last["reason"]) == ("challenge", "error", "auth")
            await said.close()
        stats = b.statistics()
        assert (stats.guard.auth_failures, stats.guard.lockouts, stats.guard.delayed) == (15, 1, 10)
        mistake = await hello(b.address, "a", secret=SECRET, bad_proof=True)  # 127.0.0.1, once
        assert mistake.last["reason"] == "auth"
        await mistake.close()
        assert (await a.connect(b.address)).engine.key == "b"
        assert b.statistics().guard.delayed == 10, "one mistake costs nothing"
        honest = await hello(b.address, "c", secret=SECRET, source="127.0.0.2")
        assert honest.welcomed, "an honest peer behind the guesser's address is delayed, not refused"
        await honest.close()
        assert b.statistics().guard.delayed == 11


async def _refused_after_challenge(address: str, answer: object | None) -> dict[str, object]:
    """Say an authenticating hello as "c", then answer the challenge with ``answer`` (None: hang up)."""
    reader, writer = await open_raw(address)
    writer.write(frame({"op": "hello", "id": 1, "engine": engine_fields("c"), "auth": True, "nonce": b64(bytes(32))}))
    await writer.drain()
    challenge = await read_message(reader)
    assert challenge["op"] == "challenge" and challenge["re"] == 1
    if answer is None:
        await close(writer)
        return {}
    writer.write(frame(answer))
    await writer.drain()
    try:
        reply = await read_message(reader) if not (isinstance(answer, dict) and answer["op"] == "error") else {}
    finally:
        await close(writer)
    return reply


REFUSALS = {
    # name: (what the client sends, the refusal's reason, its re, its message); a None reply: the client left
    "not-a-hello-first": (
        [{"op": "proof", "id": 7, "proof": b64(bytes(32))}],
        ("handshake", None, "the first control frame must be a hello request"),
    ),
    "short-nonce": (
        [{"op": "hello", "id": 3, "engine": engine_fields("c"), "auth": True, "nonce": b64(bytes(16))}],
        ("auth", 3, "the hello's nonce must have 32 bytes"),
    ),
    "no-secret": (
        [{"op": "hello", "id": 4, "engine": engine_fields("c")}],
        ("auth", 4, "engine 'b' accepts only peers that prove its shared secret, and 'c' has none"),
    ),
    "challenge-answered-by-a-hello": (
        {"op": "hello", "id": 2, "engine": engine_fields("c")},
        ("auth", None, "a challenge must be answered with a proof"),
    ),
    "wrong-proof": (
        {"op": "proof", "id": 5, "proof": b64(bytes(32))},
        ("auth", 5, "'c''s proof does not match engine 'b''s secret"),
    ),
    "challenge-refused": (
        {"op": "error", "re": 1, "reason": "auth", "message": "your proof is wrong"},
        (None, None, "the dialer did not accept this engine's proof: your proof is wrong"),
    ),
    "left-before-proving": (
        None,
        (None, None, "the dialer did not accept this engine's proof: it closed the connection before proving"),
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
async def test_every_refused_hello_answers_its_request_and_says_why_to_both_ends(
    backend: str, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A hello the listener refuses gets one ``error`` naming the request it refuses (``re``, none for a
    frame that was no request of the hello's), its reason and a message saying what was wrong; the
    listener's one warning says the same (also when the client left and cannot be told)."""
    sent, (reason, re, message) = REFUSALS[case]
    async with IOEngine("b", IOEngineConfig(backend=backend, secret=SECRET)) as b:
        caplog.clear()
        if isinstance(sent, list):
            reader, writer = await open_raw(b.address)
            writer.write(b"".join(frame(m) for m in sent))
            await writer.drain()
            reply = await read_message(reader)
            await close(writer)
        else:
            reply = await _refused_after_challenge(b.address, sent)
        if reason is None:
            assert reply == {}  # nobody left to answer
        else:
            assert (reply["op"], reply["reason"], reply["re"], reply["message"]) == ("error", reason, re, message)
        await until(lambda: b.statistics().guard.rogue_hellos == 1)
        lines = warnings(caplog)
        assert len(lines) == 1 and lines[0].endswith(message), lines
        assert b.statistics().peers.peers == 0
