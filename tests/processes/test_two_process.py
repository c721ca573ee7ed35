"""Two real processes on loopback: bulk data, a peer killed mid-batch, a region deregistered under a session."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal

import numpy as np
import pytest

from moriio_async import IOEngine, IOEngineConfig, TransferError, WcStatus, waiting_for_transfer_complete

from .conftest import Target

MiB = 1 << 20


def backend_of(request: pytest.FixtureRequest) -> str:
    return str(request.node.callspec.params["target"])


@pytest.mark.slow
async def test_256_mib_read_and_written_back_in_1_mib_blocks(target: Target, request: pytest.FixtureRequest) -> None:
    size = 256 * MiB
    await target.call(cmd="register", name="kv", size=size, seed=11)
    expected = np.random.default_rng(11).integers(0, 256, size, dtype=np.uint8)
    local = np.zeros(size, dtype=np.uint8)
    async with IOEngine("init", IOEngineConfig(backend=backend_of(request))) as engine:
        desc = engine.register_memory(local)
        peer = await engine.connect(target.address)
        session = await engine.create_session(desc, peer.memory["kv"])
        offsets = list(range(0, size, MiB))
        # Odd blocks first, then even ones, so blocks are not all contiguous.
        order = offsets[1::2] + offsets[0::2]
        batches = [order[i : i + 16] for i in range(0, len(order), 16)]
        reads = [session.batch_read(b, b, [MiB] * len(b)) for b in batches]
        await waiting_for_transfer_complete(reads, timeout=120)
        assert np.array_equal(local, expected)
        np.bitwise_not(local, out=local)
        writes = [session.batch_write(b, b, [MiB] * len(b)) for b in batches]
        await waiting_for_transfer_complete(writes, timeout=120)
    digest = (await target.call(cmd="digest", name="kv"))["sha256"]
    assert digest == hashlib.sha256(np.bitwise_not(expected)).hexdigest()


async def test_target_serves_while_its_event_loop_is_blocked(target: Target, request: pytest.FixtureRequest) -> None:
    await target.call(cmd="register", name="kv", size=4 * MiB, seed=5)
    local = np.zeros(4 * MiB, dtype=np.uint8)
    async with IOEngine("init", IOEngineConfig(backend=backend_of(request))) as engine:
        desc = engine.register_memory(local)
        peer = await engine.connect(target.address)
        session = await engine.create_session(desc, peer.memory["kv"])
        blocker = asyncio.create_task(target.call(cmd="block", seconds=2))
        await asyncio.sleep(0.2)
        await waiting_for_transfer_complete([session.read(0, 0, 4 * MiB)], timeout=1.5)
        assert not blocker.done()  # the target's loop was still blocked when the read completed
        await blocker
    assert np.array_equal(local, np.random.default_rng(5).integers(0, 256, 4 * MiB, dtype=np.uint8))


async def test_target_killed_mid_batch_fails_every_unfinished_transfer_within_the_deadline(
    target: Target, request: pytest.FixtureRequest
) -> None:
    await target.call(cmd="register", name="kv", size=64 * MiB, seed=3)
    local = np.zeros(64 * MiB, dtype=np.uint8)
    timeout = 5.0
    async with IOEngine("init", IOEngineConfig(backend=backend_of(request), retry_timeout=2.0)) as engine:
        desc = engine.register_memory(local)
        peer = await engine.connect(target.address)
        session = await engine.create_session(desc, peer.memory["kv"])
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        tick_task = asyncio.create_task(ticker())
        transfers = [session.write((i % 64) * MiB, (i % 64) * MiB, MiB) for i in range(512)]
        await asyncio.sleep(0.02)
        os.kill(target.proc.pid, signal.SIGKILL)
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(TransferError) as info:
            await waiting_for_transfer_complete(transfers, timeout=timeout)
        elapsed = loop.time() - start
        assert elapsed < timeout + 1.0
        unfinished = {t.id for t in transfers if not t.Succeeded()}
        listed = {e.transfer_id for e in info.value.exceptions}  # type: ignore[attr-defined]
        assert unfinished and listed == unfinished
        statuses = [e.wc_status for e in sorted(info.value.failed, key=lambda e: e.transfer_id)]
        assert statuses[0] is WcStatus.RETRY_EXC_ERR
        assert set(statuses[1:]) <= {WcStatus.WR_FLUSH_ERR}
        before = ticks
        await asyncio.sleep(0.1)
        assert ticks > before  # the initiator's loop kept serving
        tick_task.cancel()
        assert engine.outstanding == 0


async def test_deregistered_region_gives_remote_access_error_and_no_byte_changes(
    target: Target, request: pytest.FixtureRequest
) -> None:
    for name, seed in (("gone", 1), ("live", 2)):
        await target.call(cmd="register", name=name, size=MiB, seed=seed)
    before = {n: (await target.call(cmd="digest", name=n))["sha256"] for n in ("gone", "live")}
    local = np.full(MiB, 0xEE, dtype=np.uint8)
    async with IOEngine("init", IOEngineConfig(backend=backend_of(request))) as engine:
        desc = engine.register_memory(local)
        peer = await engine.connect(target.address)
        session = await engine.create_session(desc, peer.memory["gone"])
        await target.call(cmd="deregister", name="gone")
        transfers = [session.write(0, 0, MiB), session.batch_write([0, 4096], [8192, 0], [4096, 4096])]
        with pytest.raises(TransferError) as info:
            await waiting_for_transfer_complete(transfers, timeout=10)
        statuses = [e.wc_status for e in sorted(info.value.failed, key=lambda e: e.transfer_id)]
        assert statuses == [WcStatus.REM_ACCESS_ERR, WcStatus.WR_FLUSH_ERR]
    after = {n: (await target.call(cmd="digest", name=n))["sha256"] for n in ("gone", "live")}
    assert after == before
