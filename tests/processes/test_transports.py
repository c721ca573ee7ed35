"""A transport per peer across two processes: same host means cma, unless the kernel forbids it."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from moriio_async import IOEngine, IOEngineConfig, waiting_for_transfer_complete

from .conftest import start_target

MiB = 1 << 20
INITIATOR = Path(__file__).with_name("initiator.py")


@pytest.mark.slow
async def test_two_processes_choose_cma_by_themselves_and_move_256_mib_both_ways() -> None:
    size = 256 * MiB
    target = await start_target("auto")
    try:
        await target.call(cmd="register", name="kv", size=size, seed=11)
        expected = np.random.default_rng(11).integers(0, 256, size, dtype=np.uint8)
        local = np.zeros(size, dtype=np.uint8)
        async with IOEngine("init", IOEngineConfig(backend="auto")) as engine:
            desc = engine.register_memory(local)
            peer = await engine.connect(target.address)
            session = await engine.create_session(desc, peer.memory["kv"])
            assert session.transport == "cma", repr(session)
            blocks = list(range(0, size, 16 * MiB))
            await waiting_for_transfer_complete([session.batch_read(blocks, blocks, [16 * MiB] * 16)], timeout=60)
            assert np.array_equal(local, expected)
            np.bitwise_not(local, out=local)
            await waiting_for_transfer_complete([session.batch_write(blocks, blocks, [16 * MiB] * 16)], timeout=60)
            assert engine.statistics().peer_transports == {"target": "cma"}
        digest = (await target.call(cmd="digest", name="kv"))["sha256"]
        assert digest == hashlib.sha256(np.bitwise_not(expected)).hexdigest()
    finally:
        target.kill()
        await target.proc.wait()


async def test_when_the_kernel_forbids_cma_the_engines_fall_back_to_tcp_with_one_warning() -> None:
    size = 4 * MiB
    target = await start_target("auto", MORIIO_TEST_UNDUMPABLE="1")
    try:
        await target.call(cmd="register", name="kv", size=size, seed=5)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(INITIATOR), target.address, "kv", str(size), "5",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(INITIATOR.parents[2])},
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        result = json.loads(out)
        assert result["transport"] == "tcp" and result["matched"], result
        assert "over tcp" in result["repr"]
        warnings = [ln for ln in err.decode().splitlines() if ln.startswith(("WARNING", "ERROR"))]
        assert len(warnings) == 1, err.decode()
        assert "cma to target is not permitted, falling back to tcp" in warnings[0]
        assert "EPERM" in warnings[0]
        expected = np.bitwise_not(np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8))
        assert (await target.call(cmd="digest", name="kv"))["sha256"] == hashlib.sha256(expected).hexdigest()
    finally:
        target.kill()
        await target.proc.wait()
