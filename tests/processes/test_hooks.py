"""The engine hooks over real processes: a target learns how an initiator's transfers ended, and a
session stops being alive when its peer process dies."""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import pytest

from moriio_async import IOEngine, IOEngineConfig, StatusCode, TransferFailed

from .conftest import Target

KiB = 1 << 10


def backend_of(request: pytest.FixtureRequest) -> str:
    return str(request.node.callspec.params["target"])


async def test_inbound_status_reaches_the_target_process(target: Target, request: pytest.FixtureRequest) -> None:
    await target.call(cmd="register", name="kv", size=64 * KiB, seed=3)
    local = np.zeros(64 * KiB, dtype=np.uint8)
    async with IOEngine("init", IOEngineConfig(backend=backend_of(request))) as engine:
        desc = engine.register_memory(local)
        peer = await engine.connect(target.address)
        session = await engine.create_session(desc, peer.memory["kv"])
        await session.write(0, 0, 4 * KiB)  # no uid: the target hears nothing of it
        uids = [engine.allocate_transfer_uid() for _ in range(3)]
        transfers = [
            session.batch_read([0, 8 * KiB], [0, 16 * KiB], [4 * KiB, 4 * KiB], uid=uids[0]),
            session.write(0, 32 * KiB, 4 * KiB, uid=uids[1]),
            session.read(0, 63 * KiB, 1024, uid=uids[2]),
        ]
        await engine.waiting_for_transfer_complete(transfers, timeout=30)
        for uid in uids:
            reply = await target.call(cmd="inbound", peer="init", uid=uid, timeout=10)
            assert reply["code"] == StatusCode.SUCCESS
        # Popped once each, and the uid-less write (announced first, had it been) left nothing.
        assert (await target.call(cmd="inbound", peer="init", uid=uids[0], timeout=0.05))["code"] is None
        assert (await target.call(cmd="stats"))["inbound_statuses"] == 0


async def test_session_alive_until_the_peer_process_dies(target: Target, request: pytest.FixtureRequest) -> None:
    await target.call(cmd="register", name="kv", size=64 * KiB, seed=4)
    local = np.zeros(64 * KiB, dtype=np.uint8)
    async with IOEngine("init", IOEngineConfig(backend=backend_of(request), retry_timeout=1.0)) as engine:
        desc = engine.register_memory(local)
        peer = await engine.connect(target.address)
        session = await engine.create_session(desc, peer.memory["kv"])
        await session.read(0, 0, 4 * KiB)
        assert session.alive()
        os.kill(target.proc.pid, signal.SIGKILL)
        await target.proc.wait()
        async with asyncio.timeout(10):
            while session.alive():  # noqa: ASYNC110 (polls session state)
                await asyncio.sleep(0.01)
        t = session.read(0, 0, 4 * KiB)
        with pytest.raises(TransferFailed):
            await t.wait(30)
        assert t.Failed() and not session.alive()
