"""The prefill server's READ mode, in one process: blocks lent to a reader, and how long a lease lasts."""

from __future__ import annotations

import asyncio

import pytest

from moriio_async.serving.config import InstanceSettings
from moriio_async.serving.instance import Instance
from moriio_async.serving.messages import PrefillRequest
from moriio_async.serving.model import ModelConfig
from moriio_async.serving.prefill import PrefillServer

pytestmark = pytest.mark.timeout(60)

SMALL = ModelConfig(d_model=16, n_layers=2, n_heads=2, d_ff=32, block_size=4, max_model_len=32)
BLOCKS = 16
PROMPT = [1, 2, 3, 4, 5]  # two blocks of 4 tokens


async def test_lent_blocks_are_held_for_the_lease_timeout_then_go_back_to_the_pool() -> None:
    """A lease outlives every control deadline (a reader may take its whole transfer deadline, then abort);
    one never released expires after ``lease_timeout``, never before, and its blocks are free again."""
    settings = InstanceSettings(
        "prefill-0", "prefill", SMALL, BLOCKS, backend="mock", transfer_timeout=0.5, control_timeout=0.05
    )
    inst = Instance(settings)
    await inst.start()
    try:
        server = PrefillServer(inst)
        loop = asyncio.get_running_loop()
        lent_at = loop.time()
        answer = await server.prefill(PrefillRequest("r", PROMPT, "read"))
        lent = len(answer.block_ids)
        assert lent == 2 and inst.pool.stats()["in_flight"] == lent
        await asyncio.sleep(4 * settings.control_timeout)
        assert inst.pool.stats()["in_flight"] == lent, "past a control deadline the reader still holds them"
        while inst.pool.stats()["in_flight"]:
            assert loop.time() - lent_at < 10 * settings.lease_timeout, "the lease never expired"
            await asyncio.sleep(0.02)
        assert loop.time() - lent_at >= settings.lease_timeout
        assert inst.pool.stats()["free"] == BLOCKS and "r" not in server.leases
    finally:
        await inst.close()


async def test_a_released_or_aborted_lease_frees_its_blocks_at_once() -> None:
    settings = InstanceSettings("prefill-0", "prefill", SMALL, BLOCKS, backend="mock")
    inst = Instance(settings)
    await inst.start()
    try:
        server = PrefillServer(inst)
        first = await server.prefill(PrefillRequest("a", PROMPT, "read"))
        await server.prefill(PrefillRequest("b", PROMPT, "read"))
        assert inst.pool.stats()["in_flight"] == 2 * len(first.block_ids)
        server.abort("a")
        assert inst.pool.stats()["in_flight"] == len(first.block_ids) and set(server.leases) == {"b"}
        server.abort("b")
        assert inst.pool.stats()["free"] == BLOCKS and not server.leases
    finally:
        await inst.close()
