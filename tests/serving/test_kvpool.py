"""The block pool's accounting, the merged transfer segments, and the WRITE-mode rendezvous."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from moriio_async.serving.kvpool import KVLayout, KVPool, PoolExhausted, transfer_segments
from moriio_async.serving.messages import EngineRef, RemoteBlocks
from moriio_async.serving.model import Model, ModelConfig
from moriio_async.serving.rendezvous import Abandoned, Rendezvous

SMALL = ModelConfig(d_model=16, n_layers=2, n_heads=2, d_ff=32, block_size=4, max_model_len=64)


def pool(blocks: int = 8) -> KVPool:
    return KVPool(Model(SMALL).new_cache(blocks))


def test_layout_follows_the_array() -> None:
    p = pool(8)
    assert p.layout == KVLayout(layers=2, num_blocks=8, block_bytes=SMALL.block_bytes)
    raw = p.array.view(np.uint8).reshape(-1)
    p.array[1, 1, 5] = 7.0  # V of block 5 at layer 1
    start = p.layout.offset(1, 1, 5)
    assert raw[start : start + SMALL.block_bytes].view(np.float32).tolist() == [7.0] * (SMALL.block_bytes // 4)
    assert not raw[:start].any() and not raw[start + SMALL.block_bytes :].any()


def test_accounting_allocated_free_in_flight() -> None:
    p = pool(8)
    a = p.try_allocate(3)
    assert a == [0, 1, 2]  # lowest ids first: a request's blocks tend to be contiguous
    assert p.stats() == {"capacity": 8, "free": 5, "allocated": 3, "in_flight": 0, "peak": 3}
    with p.in_flight(a[:2]):
        assert p.in_flight_blocks == 2
        with pytest.raises(ValueError, match="in flight"):
            p.free(a)
    p.free(a)
    assert p.stats()["allocated"] == 0 and p.free_blocks == 8
    with pytest.raises(ValueError, match="not allocated"):
        p.free([0])
    with pytest.raises(ValueError, match="not allocated"):
        p.begin_flight([3])
    assert p.try_allocate(9 - 1) is not None and p.try_allocate(1) is None
    with pytest.raises(ValueError, match=r"1\.\.8"):
        p.try_allocate(9)


def test_flight_marks_nest() -> None:
    p = pool(4)
    ids = p.try_allocate(2)
    assert ids is not None
    p.begin_flight(ids)
    p.begin_flight(ids[:1])
    p.end_flight(ids)
    assert p.in_flight_blocks == 1
    p.end_flight(ids[:1])
    assert p.in_flight_blocks == 0
    for _ in range(3):
        p.begin_flight(ids[:1])
    p.end_flight(ids[:1])
    p.end_flight(ids[:1])
    assert p.in_flight_blocks == 1, "three marks need three ends"
    p.end_flight(ids[:1])
    assert p.in_flight_blocks == 0


async def test_allocate_waits_for_a_free_then_gives_up() -> None:
    p = pool(4)
    held = p.try_allocate(4)
    assert held is not None
    waiter = asyncio.create_task(p.allocate(2, timeout=5))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    p.free(held[:2])
    assert sorted(await waiter) == held[:2]
    with pytest.raises(PoolExhausted, match="no 3 free KV blocks"):
        await p.allocate(3, timeout=0.05)


def test_segments_merge_contiguous_runs_on_both_sides() -> None:
    local, remote = KVLayout(2, 8, 64), KVLayout(2, 16, 64)
    lo, ro, sz = transfer_segments(local, [2, 3, 4], remote, [10, 11, 12], layer=1)
    # One run for K, one for V.
    assert sz == [192, 192]
    assert lo == [local.offset(1, 0, 2), local.offset(1, 1, 2)]
    assert ro == [remote.offset(1, 0, 10), remote.offset(1, 1, 10)]
    # Contiguous locally only: no merge; pairs are sorted by local id.
    lo, ro, sz = transfer_segments(local, [4, 3], remote, [1, 7], layer=0)
    assert sz == [64] * 4 and lo[:2] == [local.offset(0, 0, 3), local.offset(0, 0, 4)]
    assert ro[:2] == [remote.offset(0, 0, 7), remote.offset(0, 0, 1)]
    with pytest.raises(ValueError, match="incompatible"):
        transfer_segments(local, [0], KVLayout(3, 8, 64), [0], 0)
    with pytest.raises(ValueError, match=r"^local and remote block lists differ in length$"):
        transfer_segments(local, [0, 1], remote, [0], 0)


def test_segments_move_exactly_the_blocks_asked_for() -> None:
    """Copying bytes by the segments (what the NIC does) lands every block where the table says."""
    src, dst = pool(8), pool(12)
    rng = np.random.default_rng(0)
    src.array[:] = rng.standard_normal(src.array.shape).astype(np.float32)
    s_ids, d_ids = [1, 2, 3, 6], [9, 10, 4, 5]
    s_raw, d_raw = src.array.view(np.uint8).reshape(-1), dst.array.view(np.uint8).reshape(-1)
    for layer in range(SMALL.n_layers):
        for lo, ro, n in zip(*transfer_segments(dst.layout, d_ids, src.layout, s_ids, layer), strict=True):
            d_raw[lo : lo + n] = s_raw[ro : ro + n]  # a READ: local = decode, remote = prefill
    for s, d in zip(s_ids, d_ids, strict=True):
        assert np.array_equal(dst.array[:, :, d], src.array[:, :, s])
    untouched = [b for b in range(12) if b not in d_ids]
    assert not dst.array[:, :, untouched].any()


def test_check_blocks() -> None:
    layout = KVLayout(2, 8, 64)
    layout.check_blocks([0, 7])
    for bad in ([8], [-1], [1, 1]):
        with pytest.raises(ValueError, match=r"^block ids must be distinct and within 0\.\.7$"):
            layout.check_blocks(bad)


# -- the WRITE-mode rendezvous ---------------------------------------------------------------------


def blocks_msg(rid: str) -> RemoteBlocks:
    return RemoteBlocks(rid, [1, 2], KVLayout(2, 8, 64), EngineRef("decode-0", "127.0.0.1:1", 1))


async def test_rendezvous_meets_in_either_order() -> None:
    orphans: list[tuple[str, str]] = []
    rv = Rendezvous(ttl=5, limit=8, on_orphan=lambda m, why: orphans.append((m.request_id, why)))
    assert rv.deliver(blocks_msg("a")) == ""
    assert (await rv.claim("a", 1)).request_id == "a"
    claim = asyncio.create_task(rv.claim("b", 1))
    await asyncio.sleep(0)
    assert rv.deliver(blocks_msg("b")) == ""
    assert (await claim).block_ids == [1, 2]
    assert len(rv) == 0 and orphans == []


async def test_rendezvous_refuses_blocks_of_a_request_that_gave_up() -> None:
    orphans: list[str] = []
    rv = Rendezvous(ttl=5, limit=8, on_orphan=lambda m, why: orphans.append(m.request_id))
    with pytest.raises(Abandoned, match="no remote_blocks"):
        await rv.claim("late", 0.01)
    assert rv.deliver(blocks_msg("late")) == "the prefill request already ended"
    rv.abandon("gone")
    assert rv.deliver(blocks_msg("gone")) != ""
    assert rv.deliver(blocks_msg("dup")) == "" and rv.deliver(blocks_msg("dup")) == "duplicate remote_blocks"


async def test_rendezvous_hands_unclaimed_blocks_back_and_stays_bounded() -> None:
    orphans: list[str] = []
    rv = Rendezvous(ttl=0.02, limit=2, on_orphan=lambda m, why: orphans.append(m.request_id))
    assert rv.deliver(blocks_msg("x")) == "" and rv.deliver(blocks_msg("y")) == ""
    assert rv.deliver(blocks_msg("z")) == "too many requests waiting for their blocks"
    await asyncio.sleep(0.1)
    assert sorted(orphans) == ["x", "y"] and len(rv) == 0


async def test_rendezvous_abandon_ends_a_waiting_claim() -> None:
    rv = Rendezvous(ttl=5, limit=8, on_orphan=lambda m, why: None)
    claim = asyncio.create_task(rv.claim("p", 5))
    await asyncio.sleep(0)
    rv.abandon("p")
    with pytest.raises(Abandoned, match=r"^abandoned by the proxy$"):
        await claim


async def test_rendezvous_lets_one_prefill_request_claim_a_request_id() -> None:
    """A second prefill request under the same id is refused while the first waits: one writer per blocks."""
    rv = Rendezvous(ttl=5, limit=8, on_orphan=lambda m, why: None)
    first = asyncio.create_task(rv.claim("r", 5))
    await asyncio.sleep(0)
    with pytest.raises(Abandoned, match="already being prefilled"):
        await rv.claim("r", 5)
    assert rv.deliver(blocks_msg("r")) == ""
    assert (await first).request_id == "r"


def test_a_pool_takes_only_a_contiguous_six_dimensional_cache_with_k_and_v() -> None:
    cache = Model(SMALL).new_cache(4)
    for bad in (cache[0], cache[:, :1], cache[:, :, ::2], np.zeros((2, 3, 4, 4, 2, 8), np.float32)):
        with pytest.raises(ValueError, match=r"^the cache must be a C-contiguous \(layers, 2, blocks, block_size"):
            KVPool(bad)
    assert KVPool(cache).layout.block_bytes == SMALL.block_bytes


def test_peak_is_the_most_blocks_ever_allocated_at_once() -> None:
    p = pool(8)
    a = p.try_allocate(5)
    assert a is not None and p.peak == 5
    p.free(a[1:])
    b = p.try_allocate(2)
    assert b is not None and p.peak == 5 and p.allocated_blocks == 3
    c = p.try_allocate(5)
    assert c is not None and p.peak == 8


def test_a_request_needs_at_least_one_block() -> None:
    p = pool(4)
    for n in (0, -1):
        with pytest.raises(ValueError, match=r"1\.\.4 blocks, not"):
            p.try_allocate(n)
    assert p.try_allocate(4) == [0, 1, 2, 3]


async def test_allocate_returns_at_once_when_enough_blocks_are_free() -> None:
    p = pool(4)
    assert await p.allocate(4, timeout=5) == [0, 1, 2, 3]
    with pytest.raises(PoolExhausted, match=r"^no 1 free KV blocks within 0\.01s \(0/4 free\)$"):
        await p.allocate(1, timeout=0.01)


def test_a_free_that_names_a_block_in_flight_frees_none_of_them() -> None:
    p = pool(4)
    ids = p.try_allocate(3)
    assert ids is not None
    p.begin_flight(ids[2:])
    with pytest.raises(ValueError, match="block 2 is still in flight"):
        p.free(ids)
    assert p.allocated_blocks == 3 and p.free_blocks == 1
    with pytest.raises(ValueError, match="block 3 is not allocated"):
        p.free([0, 3])
    assert p.allocated_blocks == 3
    p.end_flight(ids[2:])
    p.free(ids)
    assert p.try_allocate(4) == [0, 1, 2, 3]  # freed blocks are handed out lowest first again


def test_segments_of_no_blocks_are_empty_and_a_layout_differing_only_in_blocks_is_compatible() -> None:
    local, remote = KVLayout(2, 8, 64), KVLayout(2, 16, 64)
    assert transfer_segments(local, [], remote, [], 0) == ([], [], [])
    with pytest.raises(ValueError, match="incompatible"):
        transfer_segments(local, [0], KVLayout(2, 8, 32), [0], 0)
    lo, ro, sz = transfer_segments(local, [0, 1, 5], remote, [3, 9, 10], layer=1)
    # 0 and 1 are neighbours only locally, 1 and 5 only remotely: three runs per plane, in local order.
    assert sz == [64] * 6
    assert lo == [local.offset(1, kv, b) for kv in (0, 1) for b in (0, 1, 5)]
    assert ro == [remote.offset(1, kv, b) for kv in (0, 1) for b in (3, 9, 10)]


def test_a_layout_offset_counts_layers_then_k_and_v_then_blocks() -> None:
    layout = KVLayout(layers=3, num_blocks=5, block_bytes=7)
    assert [layout.offset(0, 0, b) for b in range(5)] == [0, 7, 14, 21, 28]
    assert layout.offset(0, 1, 0) == 5 * 7 and layout.offset(1, 0, 0) == 10 * 7 and layout.offset(2, 1, 4) == 29 * 7


async def test_rendezvous_ends_a_claim_whose_slot_outlived_its_ttl() -> None:
    """The slot's ttl bounds a claim too: past it the claim ends (``expired``), whatever its own timeout."""
    rv = Rendezvous(ttl=0.02, limit=8, on_orphan=lambda m, why: None)
    with pytest.raises(Abandoned, match=r"^expired$"):
        await rv.claim("slow", 5)
    assert len(rv) == 0
    assert rv.deliver(blocks_msg("slow")) == ""  # a new slot: the tombstone went with the ttl


async def test_rendezvous_a_met_slots_ttl_does_not_end_a_later_slot_of_the_same_id() -> None:
    """A request id met once may come again (a retry on this instance): the first slot's ttl ended with
    it, so the new slot lives its own ttl (its blocks are neither handed back nor refused early)."""
    ttl, loop = 0.5, asyncio.get_running_loop()
    for _ in range(5):  # a loop stalled past the second slot's ttl breaks the premise: try again
        orphans: list[str] = []
        rv = Rendezvous(ttl=ttl, limit=8, on_orphan=lambda m, why: orphans.append(why))  # noqa: B023
        assert rv.deliver(blocks_msg("again")) == ""
        first_due = loop.time() + ttl  # the first slot's ttl ends by then
        assert (await rv.claim("again", 1)).request_id == "again"
        await asyncio.sleep(0.4)
        second_due = loop.time() + ttl  # the second slot's ttl ends after this
        assert rv.deliver(blocks_msg("again")) == ""
        await asyncio.sleep(first_due + 0.001 - loop.time())  # resumes after every timer due by first_due ran
        if loop.time() >= second_due:
            continue
        assert len(rv) == 1 and orphans == []
        assert (await rv.claim("again", 1)).request_id == "again"
        assert len(rv) == 0 and orphans == []
        return
    pytest.fail("the loop stalled past the second slot's ttl at every try")


async def test_rendezvous_hands_back_blocks_that_came_as_the_claim_gave_up() -> None:
    orphans: list[tuple[str, str]] = []
    rv = Rendezvous(ttl=5, limit=8, on_orphan=lambda m, why: orphans.append((m.request_id, why)))
    claim = asyncio.create_task(rv.claim("r", 5))
    await asyncio.sleep(0)
    assert rv.deliver(blocks_msg("r")) == ""
    claim.cancel()  # before the claim woke to take them
    with pytest.raises(asyncio.CancelledError):
        await claim
    assert orphans == [("r", "the prefill request gave up")] and len(rv) == 0


async def test_rendezvous_claim_times_out_with_its_timeout_in_the_message_and_refuses_late_blocks() -> None:
    orphans: list[str] = []
    rv = Rendezvous(ttl=5, limit=8, on_orphan=lambda m, why: orphans.append(why))
    with pytest.raises(Abandoned, match=r"^decode sent no remote_blocks within 0\.015s$"):
        await rv.claim("r", 0.015)
    assert len(rv) == 1, "a tombstone stays until the ttl"
    assert rv.deliver(blocks_msg("r")) == "the prefill request already ended" and orphans == []
    with pytest.raises(Abandoned, match="already being prefilled"):
        await rv.claim("r", 5)


async def test_rendezvous_full_table_refuses_claims_and_ignores_aborts() -> None:
    orphans: list[tuple[str, str]] = []
    rv = Rendezvous(ttl=0.05, limit=1, on_orphan=lambda m, why: orphans.append((m.request_id, why)))
    assert rv.deliver(blocks_msg("x")) == ""
    with pytest.raises(Abandoned, match=r"^too many requests waiting for their blocks$"):
        await rv.claim("y", 5)
    rv.abandon("y")
    assert len(rv) == 1
    assert (await rv.claim("x", 5)).request_id == "x" and len(rv) == 0
    await asyncio.sleep(0.1)
    assert orphans == [], "a claimed slot never expires into an orphan"


async def test_rendezvous_expiry_hands_back_only_blocks_nobody_claimed() -> None:
    orphans: list[tuple[str, str]] = []
    rv = Rendezvous(ttl=0.02, limit=8, on_orphan=lambda m, why: orphans.append((m.request_id, why)))
    rv.abandon("gone")  # a tombstone, no blocks
    assert rv.deliver(blocks_msg("kept")) == ""
    await asyncio.sleep(0.1)
    assert orphans == [("kept", "no prefill request claimed these blocks in time")] and len(rv) == 0


async def test_rendezvous_blocks_delivered_as_the_ttl_ends_go_to_the_waiting_claim_and_nowhere_else() -> None:
    """Delivery and the slot's ttl come due in one turn of the loop, delivery first: the claim already waits
    for these blocks, so they are its own; handing them back too would let decode reuse blocks prefill writes."""
    orphans: list[str] = []
    rv = Rendezvous(ttl=0.05, limit=8, on_orphan=lambda m, why: orphans.append(why))
    claim = asyncio.create_task(rv.claim("r", 5))
    await asyncio.sleep(0)  # the claim made the slot and its ttl timer
    asyncio.get_running_loop().call_later(0.01, rv.deliver, blocks_msg("r"))
    time.sleep(0.1)  # noqa: ASYNC251 (holds the loop so both timers are due in one turn)
    assert (await claim).request_id == "r"
    assert orphans == [] and len(rv) == 0
