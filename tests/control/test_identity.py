"""Identity: a link speaks for the engine key its hello proved, whatever its frames carry.

A done notice, a notification or a ``close_qp`` is filed under, delivered as
or checked against the key the link authenticated as; a key in a frame's body
is never looked at. A listener cannot prove one identity and welcome as
another, nor list another engine's regions as its own. Proofs are checked in
constant time. The limit that remains (one shared secret: any holder may
prove any key) is docs/security.md's, and is shown here as what it is.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import logging
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from moriio_async import AuthenticationError, ControlPlaneError, IOEngine, IOEngineConfig, StatusCode
from moriio_async import waiting_for_transfer_complete as wait_all
from moriio_async.core.auth import Transcript

from ..engine.conftest import Pair, make_pair
from .wire import b64, engine_fields, frame, hello, proven_transports, read_message, until

SECRET = b"the-shared-secret-of-this-test-run"


@pytest.fixture
async def secured(backend: str) -> AsyncIterator[Pair]:
    """Engines a and b sharing SECRET, with a session from a to b (so b answers a pair for a)."""
    a, b, p = await make_pair(backend, secret=SECRET)
    try:
        yield p
    finally:
        await a.close()
        await b.close()


def dropped(caplog: pytest.LogCaptureFixture, what: str) -> list[str]:
    return [m for r in caplog.records if f"{what} dropped" in (m := r.getMessage())]


async def test_notices_speak_for_the_key_their_link_proved_never_one_in_their_body(
    secured: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    """Engine c holds the secret and proves its own key; its done notice, notification and close_qps
    name engine a (in fields the protocol ignores, and by a's pair numbers): a's statuses,
    notifications and answering pair are untouched, and c's are c's."""
    caplog.set_level(logging.INFO, logger="moriio_async")
    p = secured
    before = p.b.statistics()
    c = await hello(p.b.address, "c", secret=SECRET)
    assert c.welcomed
    claims = {"engine": "a", "key": "a", "peer": "a", "engine_key": "a"}
    await c.send({"op": "done", "uid": 5, "code": 0, **claims})
    await c.send({"op": "notify", "data": b64(b"as a?"), **claims})
    # a's answering pair on b is one of these numbers (every backend numbers its pairs from 0x10 or 0x100).
    await c.send(*({"op": "close_qp", "qp": n, **claims} for n in range(0x1000)))
    await c.send({"op": "notify", "data": b64(b"last"), **claims})  # a link's notices are taken in order
    notes = [await p.b.recv_notification(timeout=5) for _ in range(2)]
    assert [(n.peer, n.data) for n in notes] == [("c", b"as a?"), ("c", b"last")]
    assert p.b.pop_inbound_transfer_status("a", 5) is None, "c's done notice was filed as a's"
    assert p.b.pop_inbound_transfer_status("c", 5) is StatusCode.SUCCESS
    assert p.b.statistics().peers.answering_qps == before.peers.answering_qps, "c closed a's answering pair"
    assert any("not one engine 'c' asked for" in line for line in dropped(caplog, "CloseQp")), caplog.text
    await wait_all([p.session.read(0, 0, 4096)], timeout=10)  # a's session is whole
    await c.close()


async def test_the_limit_of_one_shared_secret_any_holder_can_prove_any_key(secured: Pair) -> None:
    """What docs/security.md says remains: a holder of the secret that proves a's key
    (at a's incarnation) speaks as a. This is the control for the test above: the same close_qps,
    from a link that proved a, do close a's answering pair."""
    p = secured
    before = p.b.statistics().peers.answering_qps
    as_a = await hello(p.b.address, "a", incarnation=p.a.incarnation, secret=SECRET)
    assert as_a.welcomed
    await as_a.send(*({"op": "close_qp", "qp": n} for n in range(0x1000)))
    await until(lambda: p.b.statistics().peers.answering_qps < before)
    await as_a.close()


# -- the dialer's side: who welcomes is who proved, and lists only its own regions ---------------------


def region(engine: dict[str, Any], **change: Any) -> dict[str, Any]:
    fields = {"engine_key": engine["key"], "incarnation": engine["incarnation"], "name": "kv", "addr": 4096,
              "length": 4096, "rkey": 1, "access": 3}  # fmt: skip
    return fields | change


Lie = Callable[[dict[str, Any]], dict[str, Any]]
"""From the engine record the rogue listener proved, the welcome it sends."""

LIES: dict[str, Lie] = {
    "another-key": lambda e: {"engine": e | {"key": "prefill-1"}, "memory": []},
    "another-incarnation": lambda e: {"engine": e | {"incarnation": e["incarnation"] + 1}, "memory": []},
    "another-engines-region": lambda e: {"engine": e, "memory": [region(e, engine_key="prefill-1")]},
    "another-incarnations-region": lambda e: {"engine": e, "memory": [region(e, incarnation=e["incarnation"] - 1)]},
}


async def rogue_listener(lie: Lie, secret: bytes | None) -> tuple[asyncio.Server, str]:
    """A listener that proves (with ``secret``) as engine prefill-0, then welcomes as ``lie`` says."""
    me = engine_fields("prefill-0", incarnation=5)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            first = await read_message(reader)
            re = first["id"]
            if secret is not None:
                nonce = os.urandom(32)
                dialer = first["engine"]
                transcript = Transcript(
                    dialer["key"], dialer["incarnation"], base64.b64decode(first["nonce"]), me["key"],
                    me["incarnation"], nonce, proven_transports(dialer, me),
                )  # fmt: skip
                proof = transcript.proof(secret, "listener")
                writer.write(
                    frame({"op": "challenge", "re": re, "engine": me, "nonce": b64(nonce), "proof": b64(proof)})
                )
                second = await read_message(reader)
                assert second["op"] == "proof", second
                re = second["id"]
            writer.write(frame({"op": "welcome", "re": re, **lie(me)}))
            await writer.drain()
            await reader.read()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"


@pytest.mark.parametrize("lie", list(LIES))
async def test_a_listener_that_proves_as_one_engine_and_welcomes_as_another_is_refused(backend: str, lie: str) -> None:
    """Issue 25 item 1: the welcome must be the engine that proved (key and incarnation), and list
    only that engine's regions; else ``connect()`` raises ``AuthenticationError`` and learns nothing."""
    server, address = await rogue_listener(LIES[lie], SECRET)
    try:
        async with IOEngine("decode-0", IOEngineConfig(backend=backend, secret=SECRET)) as dialer:
            with pytest.raises(AuthenticationError):
                await dialer.connect(address)
            assert dialer.statistics().peers.peers == 0
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("lie", ["another-engines-region", "another-incarnations-region"])
async def test_without_a_secret_a_welcome_listing_another_engines_regions_is_refused(backend: str, lie: str) -> None:
    """Unauthenticated, a listener is whoever it says; still it cannot hand out another engine's
    regions as its own (the dialer's writes meant for it would land in that engine's memory)."""
    server, address = await rogue_listener(LIES[lie], None)
    try:
        async with IOEngine("decode-0", IOEngineConfig(backend=backend, secret="")) as dialer:
            with pytest.raises(ControlPlaneError, match="an engine lists only its own"):
                await dialer.connect(address)
            assert dialer.statistics().peers.peers == 0
    finally:
        server.close()
        await server.wait_closed()


async def test_both_sides_check_proofs_with_a_constant_time_comparison(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 25 item 2: each side's check of the other's proof goes through ``hmac.compare_digest``
    (spied on; no timing is measured)."""
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        compared.append((bytes(a), bytes(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    cfg = IOEngineConfig(backend=backend, secret=SECRET)
    async with IOEngine("a", cfg) as a, IOEngine("b", cfg) as b:
        await a.connect(b.address)
    proofs = [(x, y) for x, y in compared if len(x) == len(y) == 32]
    assert len(proofs) == 2, compared  # the dialer's check of the listener's proof, and the listener's of the dialer's
    assert all(x == y for x, y in proofs) and proofs[0] != proofs[1]
