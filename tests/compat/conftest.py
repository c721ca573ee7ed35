"""Fixtures for the compat layers: pairs of compat engines (each with its own loop thread) in one process."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import pytest

from moriio_async import IOEngineConfig as AsyncEngineConfig
from moriio_async import MockOptions
from moriio_async.compat.mori import BackendType, IOEngine, IOEngineConfig, MemoryDesc, RdmaBackendConfig

T = TypeVar("T")


def options(backend: str, **extra: Any) -> AsyncEngineConfig:
    return AsyncEngineConfig(backend=backend, mock=MockOptions(**extra))


def make_pair(
    name: str, backend: str = "tcp", rdma: RdmaBackendConfig | None = None, **extra: Any
) -> tuple[IOEngine, IOEngine]:
    """Two engines that know each other, MoRI-IO style (descriptors exchanged by hand)."""
    config = IOEngineConfig(host="127.0.0.1", port=0, options=options(backend, **extra))
    a = IOEngine(f"{name}-initiator", config)
    b = IOEngine(f"{name}-target", config)
    for engine in (a, b):
        engine.create_backend(BackendType.RDMA, rdma or RdmaBackendConfig())
    a.register_remote_engine(b.get_engine_desc())
    b.register_remote_engine(a.get_engine_desc())
    return a, b


def on_loop(engine: IOEngine, fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn`` on the engine's loop thread (where the moriio_async objects live) and return its result."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def job() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as exc:
            future.set_exception(exc)

    engine.loop.call_soon_threadsafe(job)
    return future.result(10)


def register(engine: IOEngine, nbytes: int, fill: int | None = None) -> tuple[np.ndarray, MemoryDesc]:
    rng = np.random.default_rng()
    buf = rng.integers(0, 256, nbytes, dtype=np.uint8) if fill is None else np.full(nbytes, fill, dtype=np.uint8)
    return buf, engine.register_torch_tensor(buf)


@pytest.fixture(params=["tcp-uvloop", "tcp-asyncio", "mock-uvloop", "mock-asyncio"])
def pair(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[IOEngine, IOEngine]]:
    """Two engines on each backend, their loop threads running uvloop or the stock asyncio loop."""
    backend, loop = request.param.split("-")
    monkeypatch.setenv("MORIIO_COMPAT_LOOP", loop)
    a, b = make_pair(f"pair-{backend}", backend)
    assert ("uvloop" in type(a.loop).__module__) == (loop == "uvloop")
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def held() -> Iterator[tuple[IOEngine, IOEngine]]:
    """Mock engines whose queue pairs keep posted requests until the test steps them."""
    a, b = make_pair("held", "mock", RdmaBackendConfig(qp_per_transfer=2), hold=True)
    yield a, b
    a.close()
    b.close()
