"""The TCP data plane under a hostile peer, through whole engines (issue 8, data-plane half).

The hostile client says hello and asks for an answering queue pair by hand
(``wire.py``), then speaks the data wire by hand (``tests/backends/datawire.py``):
it trickles a WRITE into a region being deregistered (the loop must not stall),
guesses unexported rkeys (refused, counted per peer, logged at a rate), and
replays a derived token (refused)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import numpy as np
import pytest

from moriio_async import IOEngine, IOEngineConfig, TransferError, waiting_for_transfer_complete
from moriio_async.core.auth import token_for

from ..backends import datawire as dw
from ..control.wire import Hello, hello, read_message
from .conftest import tcp_facts

pytestmark = pytest.mark.timeout(60)

SECRET = b"the-data-plane-secret-of-this-run"


@pytest.fixture(params=["no secret", "secret"])
async def engines(request: pytest.FixtureRequest) -> AsyncIterator[tuple[IOEngine, IOEngine, bytes | None]]:
    """Engines a and b on TCP, with or without a shared secret, and that secret."""
    secret = SECRET if request.param == "secret" else None
    cfg = IOEngineConfig(backend="tcp", secret=secret or "", retry_timeout=30.0)
    a = await IOEngine("a", cfg).start()
    b = await IOEngine("b", cfg).start()
    try:
        yield a, b, secret
    finally:
        await a.close()
        await b.close()


async def answering_pair(b: IOEngine, secret: bytes | None, qp_num: int = 7) -> tuple[Hello, dict[str, Any]]:
    """Say hello to ``b`` as "hostile" and have it answer a queue pair; the link and b's endpoint."""
    said = await hello(b.address, "hostile", backend="tcp", secret=secret)
    assert said.welcomed, said.replies
    endpoint = {"backend": "tcp", "accepting": False, "host": "127.0.0.1", "port": 1, "qp_num": qp_num}
    await said.send({"op": "connect_qp", "id": 10 + qp_num, "incarnation": b.incarnation, "endpoint": endpoint})
    reply = await read_message(said.reader)
    assert reply["op"] == "qp", reply
    return said, reply["endpoint"]


def token_of(said: Hello, endpoint: dict[str, Any], qp_num: int = 7) -> bytes:
    """What the active side presents: derived from the link's session key, or the endpoint's own token."""
    if said.session_key is None:
        return bytes.fromhex(endpoint["token"])
    assert "token" not in endpoint, "with a secret the token never crosses the control link"
    return token_for(said.session_key, f"tcp-data/{endpoint['qp_num']}/{qp_num}/{endpoint['nonce']}", 0)


async def test_deregistering_under_a_trickled_write_does_not_stall_the_loop(
    engines: tuple[IOEngine, IOEngine, bytes | None],
) -> None:
    """Issue 8: a WRITE trickling one byte per 0.5 s kept its region pinned and ``deregister_memory``
    waited for it on the loop thread: the loop stood still 18.5 s. Now the receive is aborted: the
    loop's longest stall stays under 100 ms, no byte lands after deregistration returns, the peer is
    told REM_ACCESS_ERR, and a legitimate peer keeps working."""
    a, b, secret = engines
    target = np.zeros(1 << 16, np.uint8)
    desc = b.register_memory(target, name="victim")
    kept = np.arange(1 << 16, dtype=np.uint64).view(np.uint8)[: 1 << 16].copy()
    b.register_memory(kept, name="kept")
    said, endpoint = await answering_pair(b, secret)
    sock, status = await asyncio.to_thread(dw.dial, int(endpoint["port"]), token_of(said, endpoint))
    assert status == dw.OK
    sock.sendall(dw.chunk(dw.WRITE, 0, (desc.rkey, desc.addr, 4096)))
    try:
        with dw.Dripper(sock, 0.5):
            loop = asyncio.get_running_loop()
            give_up = loop.time() + 10
            while not target[0]:  # the first byte landed: the region is pinned by the receive now
                assert loop.time() < give_up
                await asyncio.sleep(0.01)
            async with dw.LoopGaps() as gaps:
                await asyncio.sleep(0.05)
                b.deregister_memory(desc)
                snapshot = target.copy()
                await asyncio.sleep(0.05)
            r = await asyncio.to_thread(dw.response, sock)
            assert (r.status, r.done) == (dw.REM_ACCESS_ERR, 0)
            await asyncio.sleep(1.2)  # two more drips would have landed
            assert np.array_equal(target, snapshot), "a byte landed after deregister_memory returned"
            assert gaps.longest < 0.1, f"the loop stood still {gaps.longest * 1000:.0f} ms"
            assert tcp_facts(b).data_plane.aborted_requests == 1
            assert b.statistics().data_plane["aborted_requests"] == 1
    finally:
        sock.close()
        await said.close()
    # A legitimate peer is unaffected.
    local = np.zeros(1 << 16, np.uint8)
    peer = await a.connect(b.address)
    session = await a.create_session(a.register_memory(local, name="l"), peer.memory["kept"])
    await waiting_for_transfer_complete([session.read(0, 0, 1 << 16)], timeout=10)
    assert np.array_equal(local, kept)
    assert "victim" not in peer.memory


async def test_unexported_rkeys_are_refused_counted_per_peer_and_logged_at_a_rate(
    engines: tuple[IOEngine, IOEngine, bytes | None], caplog: pytest.LogCaptureFixture
) -> None:
    _a, b, secret = engines
    hidden = np.full(4096, 3, np.uint8)
    desc = b.register_memory(hidden)  # no name, not exported: its rkey means nothing to a peer
    caplog.set_level(logging.WARNING)
    said, _ = await answering_pair(b, secret, 1)
    for n in range(1, 13):  # below max_failures_per_source (16): every guess is answered
        await said.send({"op": "connect_qp", "id": 100 + n, "incarnation": b.incarnation,
                         "endpoint": {"backend": "tcp", "accepting": False, "host": "127.0.0.1", "port": 1,
                                      "qp_num": 100 + n}})  # fmt: skip
        endpoint = (await read_message(said.reader))["endpoint"]
        sock, status = await asyncio.to_thread(dw.dial, int(endpoint["port"]), token_of(said, endpoint, 100 + n))
        assert status == dw.OK
        sock.sendall(dw.chunk(dw.READ, 0, (desc.rkey, desc.addr, 4096)))
        r = await asyncio.to_thread(dw.response, sock)
        assert (r.status, r.done, r.payload) == (dw.REM_ACCESS_ERR, 0, 0)
        sock.close()
    loop = asyncio.get_running_loop()
    give_up = loop.time() + 5
    while b.statistics().guard.access_errors.get("hostile", 0) < 12:
        assert loop.time() < give_up, b.statistics().guard.access_errors
        await asyncio.sleep(0.01)
    assert tcp_facts(b).data_plane.access_errors == 12
    assert b.statistics().data_plane["access_errors"] == 12
    lines = [r for r in caplog.records if "remote access refused" in r.getMessage()]
    assert 1 <= len(lines) <= 2, [r.getMessage() for r in lines]  # one per logger (engine, backend) per interval
    assert any("hostile" in r.getMessage() for r in lines)
    assert not any(r.exc_info for r in caplog.records)
    await said.close()


@pytest.mark.parametrize("secret", [None, SECRET], ids=["no secret", "secret"])
async def test_rkey_guesses_past_the_budget_each_wait_and_an_honest_mistake_costs_nothing(
    secret: bytes | None,
) -> None:
    """Issue 23: ~1,100 rkey guesses a second, unlimited. Each refused remote access is a failure charged to
    the source of the data connection: past max_failures_per_source each of its next data connections waits
    a quarter of the hello deadline before it is heard, so each guess (which needs a fresh pair) costs that
    long. An honest peer from another address that used one stale rkey is not delayed."""
    cfg = IOEngineConfig(
        backend="tcp", secret=secret or "", retry_timeout=30.0, max_failures_per_source=5, hello_timeout=0.8
    )
    async with IOEngine("b", cfg) as b, IOEngine("a", cfg) as a:
        hidden = np.full(4096, 3, np.uint8)
        desc = b.register_memory(hidden)  # not exported: a peer can only guess its rkey
        said, _ = await answering_pair(b, secret, 1)
        for n in range(2, 17):
            await said.send({"op": "connect_qp", "id": 100 + n, "incarnation": b.incarnation,
                             "endpoint": {"backend": "tcp", "accepting": False, "host": "127.0.0.1", "port": 1,
                                          "qp_num": 100 + n}})  # fmt: skip
            endpoint = (await read_message(said.reader))["endpoint"]
            token = token_of(said, endpoint, 100 + n)
            sock, status = await asyncio.to_thread(dw.dial, int(endpoint["port"]), token, 100 + n, 5.0, "127.0.0.2")
            assert status == dw.OK
            sock.sendall(dw.chunk(dw.READ, 0, (desc.rkey, desc.addr, 4096)))
            assert (await asyncio.to_thread(dw.response, sock)).status == dw.REM_ACCESS_ERR
            sock.close()
            await said.send({"op": "close_qp", "qp": endpoint["qp_num"]})
        data_plane = b.statistics().data_plane
        assert (data_plane["access_errors"], data_plane["lockouts"]) == (15, 1)
        assert data_plane["delayed"] == 10, "every data connection past the budget waited before it was heard"
        await said.close()
        # An honest peer (127.0.0.1) with one stale rkey: refused once, then served, never delayed.
        kept = np.full(4096, 9, np.uint8)
        b.register_memory(kept, name="kept")
        local = np.zeros(4096, np.uint8)
        peer = await a.connect(b.address)
        mine = a.register_memory(local, name="l")
        bad = await a.create_session(mine, msgspec.structs.replace(peer.memory["kept"], rkey=desc.rkey ^ 1, rkeys={}))
        with pytest.raises(TransferError):
            await waiting_for_transfer_complete([bad.read(0, 0, 64)], timeout=10)
        await bad.close()
        session = await a.create_session(mine, peer.memory["kept"])
        await waiting_for_transfer_complete([session.read(0, 0, 4096)], timeout=10)
        assert (local == 9).all()
        assert b.statistics().data_plane["delayed"] == 10
