"""A shared secret across real processes: the target reads it from its environment (as every example,
the compat layers and the serving demo do); a peer must prove it before it sees or touches anything."""

from __future__ import annotations

import secrets

import numpy as np
import pytest

from moriio_async import AuthenticationError, IOEngine, IOEngineConfig, waiting_for_transfer_complete

from .conftest import process_backends, start_target


@pytest.mark.parametrize("backend", process_backends())
async def test_a_target_takes_its_secret_from_the_environment(backend: str) -> None:
    secret = secrets.token_urlsafe(32)
    target = await start_target(backend, MORIIO_ASYNC_SECRET=secret)
    try:
        await target.call(cmd="register", name="kv", size=1 << 20, seed=3)
        for wrong in ("", secrets.token_urlsafe(32)):  # none at all, and another one
            async with IOEngine("intruder", IOEngineConfig(backend=backend, secret=wrong)) as intruder:
                with pytest.raises(AuthenticationError):
                    await intruder.connect(target.address)
        local = np.zeros(1 << 20, dtype=np.uint8)
        async with IOEngine("init", IOEngineConfig(backend=backend, secret=secret)) as engine:
            desc = engine.register_memory(local)
            peer = await engine.connect(target.address)
            session = await engine.create_session(desc, peer.memory["kv"])
            await waiting_for_transfer_complete([session.read(0, 0, 1 << 20)], timeout=30)
        assert np.array_equal(local, np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8))
        await target.call(cmd="exit")
    finally:
        target.kill()
        await target.proc.wait()
