from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
import pytest

from moriio_async import IOEngine, IOEngineConfig, MemoryDesc, MockOptions, Session
from moriio_async.backends.described import TcpFacts

from ..conftest import engine_backends


@dataclass
class Pair:
    """Two running engines, a registered buffer on each, and a session from a to b."""

    a: IOEngine
    b: IOEngine
    buf_a: np.ndarray
    buf_b: np.ndarray
    desc_a: MemoryDesc
    desc_b: MemoryDesc
    session: Session


SIZE = 1 << 20


def tcp_facts(engine: IOEngine) -> TcpFacts:
    """What ``engine``'s TCP backend says of itself."""
    facts = engine.describe_backend()
    assert isinstance(facts, TcpFacts), facts
    return facts


async def make_pair(backend: str, size: int = SIZE, **config: object) -> tuple[IOEngine, IOEngine, Pair]:
    cfg = IOEngineConfig(backend=backend, **config)  # type: ignore[arg-type]
    a = await IOEngine("a", cfg).start()
    b = await IOEngine("b", cfg).start()
    buf_a = np.zeros(size, dtype=np.uint8)
    buf_b = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)
    desc_a = a.register_memory(buf_a, name="kv")
    desc_b = b.register_memory(buf_b, name="kv")
    peer = await a.connect(b.address)
    session = await a.create_session(desc_a, peer.memory["kv"])
    return a, b, Pair(a, b, buf_a, buf_b, desc_a, desc_b, session)


@pytest.fixture(params=engine_backends())
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def pair(backend: str) -> AsyncIterator[Pair]:
    a, b, p = await make_pair(backend)
    try:
        yield p
    finally:
        await a.close()
        await b.close()


@pytest.fixture
async def held() -> AsyncIterator[Pair]:
    """A mock pair whose NIC runs a request only when the test says ``step``."""
    a, b, p = await make_pair("mock", mock=MockOptions(hold=True))
    try:
        yield p
    finally:
        await a.close()
        await b.close()
