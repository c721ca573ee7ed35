"""No lockout before authentication (issue 23, item 2), over real sockets from many source addresses.

A crowd of 1,000 silent or trickling sockets, each from its own loopback
address and reopened as soon as the target closes it (``siege``), is held
against the control port or the TCP data port; meanwhile a legitimate peer
connects, makes a session and transfers, with and without a shared secret.
Before: 64 silent sockets kept every ``connect`` (control port) or every
``create_session`` (data port) out. How fast it gets in is measured in
``benchmarks/siege.py``; here only that it does, within the engine's own
deadlines.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from moriio_async import IOEngine, IOEngineConfig, waiting_for_transfer_complete

from ..control.wire import hello, until
from .conftest import tcp_facts
from .siege import Siege, open_files

pytestmark = pytest.mark.timeout(180)

CROWD = 1000
SECRET = "a-secret-for-the-siege-test-only"


@pytest.mark.parametrize("secret", ["", SECRET], ids=["no-secret", "secret"])
@pytest.mark.parametrize("port", ["control", "data"])
async def test_a_legitimate_peer_gets_in_while_a_thousand_unauthenticated_sockets_are_held(
    port: str, secret: str
) -> None:
    cfg = IOEngineConfig(backend="tcp", secret=secret)
    with open_files(4 * CROWD + 1024):
        async with IOEngine("b", cfg) as b, IOEngine("a", cfg) as a:
            buf_b = np.full(1 << 16, 0x5A, np.uint8)
            buf_a = np.zeros(1 << 16, np.uint8)
            desc_b = b.register_memory(buf_b, name="kv")
            desc_a = a.register_memory(buf_a, name="kv")
            target = b.address.rpartition(":")[2] if port == "control" else tcp_facts(b).data_port
            with Siege(int(target), CROWD) as siege:
                await until(lambda: siege.opened >= CROWD, limit=30)
                await asyncio.sleep(5.0)  # the crowd has been there past every grace (hello_timeout)
                for _ in range(3):  # every time, not once: a fresh link and a fresh data connection each
                    info = await asyncio.wait_for(a.connect(b.address), cfg.control_timeout * 2)
                    session = await asyncio.wait_for(
                        a.create_session(desc_a, info.memory["kv"]), cfg.control_timeout * 2
                    )
                    await waiting_for_transfer_complete([session.read(0, 0, 1 << 16)], timeout=30)
                    assert (buf_a == 0x5A).all()
                    buf_a[:] = 0
                    await session.close()
            assert siege.closed_by_target >= 1, "the crowd was there, and held its places"
            assert desc_b.length == 1 << 16
            stats = b.statistics()
            if port == "control":
                assert stats.guard.evicted_hellos >= 1, "the crowd was held at the control port"
            else:
                assert stats.data_plane["evicted_hellos"] >= 1, "the crowd was held at the data port"


async def test_idle_links_that_said_a_valid_hello_cannot_fill_max_links(backend: str) -> None:
    """Issue 23: 512 idle links from 127.0.0.2 onwards filled max_links for good (without a secret anyone can
    say a valid hello). At the cap, the link idle the longest (carrying nothing, idle past the grace) makes
    room, so a legitimate peer connects; a link that carries a session is never the one closed."""
    cfg = IOEngineConfig(backend=backend, secret="", max_links=40, hello_timeout=1.0)
    async with IOEngine("b", cfg) as b, IOEngine("a", cfg) as a:
        held = [
            await hello(b.address, f"idle{i}", backend=backend, secret=None, source=f"127.5.0.{i + 1}")
            for i in range(40)
        ]
        assert all(h.welcomed for h in held) and b.statistics().peers.links == 40
        await asyncio.sleep(0.6)  # idle past the grace (half the 1 s hello deadline)
        for _ in range(3):
            assert (await a.connect(b.address)).engine.key == "b"
        stats = b.statistics()
        assert stats.guard.evicted_idle_links == 3 and stats.peers.links == 40 and stats.guard.refused_links == 0
        for h in held:
            await h.close()


@pytest.mark.parametrize("initiator", ["a", "b"], ids=["answering-pair", "opened-pair"])
async def test_at_max_links_a_link_carrying_a_session_is_never_the_idle_one_closed(
    backend: str, initiator: str
) -> None:
    """a dialed b first, so a's link is the oldest at b, idle as long as the rest; but it carries a session
    (a's, answered by a pair on b; or b's own, opened over that link): the links that carry nothing make room
    for a newcomer, one each, and a's link and the session stay and work."""
    cfg = IOEngineConfig(backend=backend, secret="", max_links=4, hello_timeout=1.0)
    async with IOEngine("b", cfg) as b, IOEngine("a", cfg) as a, IOEngine("c", cfg) as c:
        source = np.full(1 << 12, 0x5A, np.uint8)
        dest = np.zeros(1 << 12, np.uint8)
        exported = b.register_memory(source if initiator == "a" else dest, name="kv")
        info = await a.connect(b.address)
        if initiator == "a":
            session = await a.create_session(a.register_memory(dest), info.memory["kv"])
        else:  # b opens its pair over the link a dialed (the one b knows a by)
            session = await b.create_session(exported, a.register_memory(source, name="kv"))
        held = [
            await hello(b.address, f"idle{i}", backend=backend, secret=None, source=f"127.5.0.{i + 1}")
            for i in range(3)
        ]
        assert all(h.welcomed for h in held) and b.statistics().peers.links == 4
        await asyncio.sleep(0.6)  # every link idle past the grace (half the 1 s hello deadline)
        for _ in range(3):
            assert (await c.connect(b.address)).engine.key == "b"
        stats = b.statistics()
        assert stats.guard.evicted_idle_links == 3 and stats.peers.links == 4
        await waiting_for_transfer_complete([session.read(0, 0, 1 << 12)], timeout=10)
        assert (dest == 0x5A).all()
        for h in held:
            await h.close()
