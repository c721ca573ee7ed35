"""Engine memory registrations on real verbs: what rxe does with keys, and that the engine copes.

rxe gives every region registered without remote access the rkey 0 (seen:
``tools/guest/PYVERBS_NOTES.md``). The engine once kept its regions by rkey,
so a second such region replaced the first: deregistering the first then
failed with InvalidArgument and it stayed registered until the engine closed
(found by the bounds property in the guest, tests/PROPERTIES.md).
"""

from __future__ import annotations

import numpy as np

from moriio_async import Access, IOEngine, IOEngineConfig, waiting_for_transfer_complete

from .conftest import guest_only

pytestmark = guest_only


async def test_regions_without_remote_access_share_rkey_0_yet_each_deregisters_alone() -> None:
    cfg = IOEngineConfig(backend="verbs")
    async with IOEngine("a", cfg) as a, IOEngine("b", cfg) as b:
        served = np.arange(8192, dtype=np.uint32).view(np.uint8)[:8192]
        b.register_memory(served, name="kv")
        arena = np.zeros(3 * 4096, dtype=np.uint8)
        first = a.register_memory(arena[:4096], access=Access.LOCAL_WRITE)
        second = a.register_memory(arena[4096:8192], access=Access.LOCAL_WRITE)
        assert first.rkey == second.rkey == 0, "the premise: rxe's rkey of a region without remote access"
        a.deregister_memory(first)
        assert a.statistics().regions == 1
        peer = await a.connect(b.address)
        session = await a.create_session(second, peer.memory["kv"])
        t = session.read(0, 100, 4096)
        await waiting_for_transfer_complete([t], timeout=30)
        assert np.array_equal(arena[4096:8192], served[100:4196])
        assert not arena[:4096].any(), "the deregistered region's bytes were touched"
        await session.close()
        a.deregister_memory(second)
        assert a.statistics().regions == 0
