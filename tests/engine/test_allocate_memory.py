"""``IOEngine.allocate_memory``: a registered buffer from the backend (a memfd peers map, on cma)."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from moriio_async import InvalidArgument, IOEngine, IOEngineConfig, waiting_for_transfer_complete

SIZE = 1 << 20


async def test_an_allocated_buffer_is_registered_and_moves_both_ways(backend: str) -> None:
    cfg = IOEngineConfig(backend=backend)
    async with IOEngine("a", cfg) as a, IOEngine("b", cfg) as b:
        desc_b, shared = b.allocate_memory(SIZE, name="kv")
        assert isinstance(shared, mmap.mmap) and len(shared) == SIZE and desc_b.length == SIZE
        view_b = np.frombuffer(shared, np.uint8)
        view_b[:] = np.random.default_rng(3).integers(0, 256, SIZE, dtype=np.uint8)
        local = np.zeros(SIZE, np.uint8)
        desc_a = a.register_memory(local)
        peer = await a.connect(b.address)
        session = await a.create_session(desc_a, peer.memory["kv"])
        offsets = list(range(0, SIZE, 64 << 10))
        await waiting_for_transfer_complete([session.batch_read(offsets, offsets, [64 << 10] * len(offsets))], 10)
        assert np.array_equal(local, view_b)
        np.bitwise_not(local, out=local)
        await waiting_for_transfer_complete([session.batch_write(offsets, offsets, [64 << 10] * len(offsets))], 10)
        assert np.array_equal(local, view_b)
        await session.close()
        b.deregister_memory(desc_b)
        del view_b


async def test_allocate_memory_refuses_a_bad_size(backend: str) -> None:
    async with IOEngine("a", IOEngineConfig(backend=backend)) as a:
        for size in (0, -1, 1.5, True):
            with pytest.raises(InvalidArgument, match="allocation size"):
                a.allocate_memory(size)  # type: ignore[arg-type]
