"""The mock NIC's memory on its own: the key table, the checks over single blocks and whole arrays
(key, bounds without wraparound, access), and the array copies, which must give what copying the
blocks one after another gives, whatever their shape, overlap or number."""

from __future__ import annotations

import secrets

import numpy as np
import pytest

from moriio_async.backends.mock.memory import (
    GROUP_BYTES,
    VECTOR_MAX,
    Blocks,
    MemoryTable,
    MockRegion,
    copy,
    copy_equal,
    independent,
)
from moriio_async.errors import InvalidArgument
from moriio_async.status import Access

RW = int(Access.REMOTE_WRITE)
RR = int(Access.REMOTE_READ)
LW = int(Access.LOCAL_WRITE)
ALL = Access.all()


def register(table: MemoryTable, size: int, access: Access = ALL, seed: int = 0) -> MockRegion:
    buf = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    return table.register(memoryview(buf), access)


def one_by_one(src: list[np.ndarray], dst: list[np.ndarray], s: Blocks, d: Blocks, lengths: np.ndarray) -> None:
    """What ``copy`` must do: block i of s to block i of d, in order (src and dst may be the same arrays)."""
    for si, so, di, do, n in zip(s.which.tolist(), s.offset.tolist(), d.which.tolist(), d.offset.tolist(),
                                 lengths.tolist(), strict=True):  # fmt: skip
        dst[di][do : do + n] = src[si][so : so + n].copy()


def blocks(regions: list[MockRegion], which: list[int], offsets: list[int]) -> Blocks:
    return Blocks(regions, np.array(which, dtype=np.intp), np.array(offsets, dtype=np.int64))


# -- the key table ---------------------------------------------------------------------------------------


def test_registration_keys_and_views() -> None:
    table = MemoryTable()
    buf = np.zeros((8, 8), np.uint16)  # not bytes, 2-D: its 128 bytes
    r = table.register(memoryview(buf), Access.LOCAL_WRITE | Access.REMOTE_READ)
    assert (r.addr, r.length, r.access) == (buf.ctypes.data, 128, Access.LOCAL_WRITE | Access.REMOTE_READ)
    assert r.lkey == r.rkey and r.lkey % 2 == 1 and 0 < r.lkey < 1 << 31
    r.array[:2] = 0xFF
    assert buf.flat[0] == 0xFFFF and bytes(r.view[:2]) == b"\xff\xff"  # the region is the buffer
    keys = {register(table, 8).lkey for _ in range(2000)}
    assert len(keys) == 2000 and r.lkey not in keys
    with pytest.raises(InvalidArgument, match=r"^REMOTE_WRITE access needs LOCAL_WRITE too") as refused:
        table.register(memoryview(np.zeros(8, np.uint8)), Access.REMOTE_WRITE)
    assert refused.value.hint == "register with Access.LOCAL_WRITE | REMOTE_WRITE"


def test_a_key_drawn_again_is_redrawn_never_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    table = MemoryTable()
    draws = iter([4, 5, 5, 4, 8])  # keys 5, then 5 and 5 again (taken), then 9
    monkeypatch.setattr(secrets, "randbits", lambda bits: next(draws) & ((1 << bits) - 1))  # as randbits would
    first, second = register(table, 64), register(table, 64)
    assert (first.lkey, second.lkey) == (5, 9)
    assert table.lookup(5, first.addr, 8, 0) is first and table.lookup(9, second.addr, 8, 0) is second


def test_a_single_block_lookup_checks_key_bounds_and_access() -> None:
    table = MemoryTable()
    r = register(table, 4096, Access.LOCAL_WRITE | Access.REMOTE_READ)
    a = r.addr
    for addr, length, need, found in [
        (a, 4096, 0, True),
        (a + 4095, 1, LW | RR, True),
        (a + 4096, 0, RR, True),
        (a + 4096, 1, 0, False),
        (a - 1, 1, 0, False),
        (a + 1, 4096, 0, False),
        (a + 8, -1, 0, False),
        (a, 8, RW, False),
        (a, 8, RW | RR, False),
    ]:
        assert (table.lookup(r.lkey, addr, length, need) is r) is found, (addr - a, length, need)
    assert table.lookup(r.lkey + 2, a, 8, 0) is None
    assert table.usable(r.lkey, LW | RR) == (r, a, a + 4096)
    assert table.usable(r.lkey, RW) is None and table.usable(r.lkey + 2, 0) is None
    table.deregister(r)
    assert table.lookup(r.lkey, a, 8, 0) is None and table.usable(r.lkey, 0) is None


def test_deregistration_drops_only_the_region_registered_under_its_key() -> None:
    table, other = MemoryTable(), MemoryTable()
    r = register(table, 64)
    stranger = register(other, 64)
    table.deregister(stranger)  # not this table's: nothing happens (nor for its key, were it the same)
    look_alike = MockRegion(r.addr, r.length, r.lkey, r.rkey, r.access, r.view, r.array)
    table.deregister(look_alike)
    assert table.lookup(r.lkey, r.addr, 8, 0) is r
    table.deregister(r)
    table.deregister(r)
    assert table.lookup(r.lkey, r.addr, 8, 0) is None
    s = register(table, 64)
    table.clear()
    assert table.usable(s.lkey, 0) is None
    assert not table.resolve(np.array([s.lkey], np.uint32), np.array([s.addr], np.uint64),
                             np.array([8], np.uint64), Access(0)).ok.any()  # fmt: skip


def test_resolve_checks_every_triple_and_places_it_in_its_region() -> None:
    table = MemoryTable()
    x = register(table, 4096)
    y = register(table, 4096, Access.LOCAL_WRITE | Access.REMOTE_READ)
    triples = [  # (key, addr, length, ok for REMOTE_READ, ok for REMOTE_WRITE)
        (x.lkey, x.addr, 4096, True, True),
        (y.lkey, y.addr + 4000, 96, True, False),
        (y.lkey, y.addr + 4096, 0, True, False),
        (x.lkey, x.addr + 4096, 1, False, False),
        (y.lkey, y.addr - 1, 2, False, False),
        (x.lkey, x.addr + 8, 2**64 - 4, False, False),  # addr + length wraps
        (x.lkey, 2**64 - 1, 2, False, False),
        (x.lkey, y.addr, 8, False, False),
        (y.lkey + 2, y.addr, 8, False, False),
        (x.lkey, x.addr + 100, 8, True, True),
    ]
    keys = np.array([t[0] for t in triples], np.uint32)
    addrs = np.array([t[1] for t in triples], np.uint64)
    lengths = np.array([t[2] for t in triples], np.uint64)
    for need, col in ((Access.REMOTE_READ, 3), (Access.REMOTE_WRITE, 4)):
        res = table.resolve(keys, addrs, lengths, need)
        assert res.ok.tolist() == [t[col] for t in triples], need
        for i, t in enumerate(triples):
            if t[col]:
                region = x if t[0] == x.lkey else y
                assert res.regions[res.index[i]] is region and res.offset[i] == t[1] - region.addr
    # One key throughout, and none at all.
    same = table.resolve(keys[[0, 3, 9]], addrs[[0, 3, 9]], lengths[[0, 3, 9]], Access.REMOTE_WRITE)
    assert same.ok.tolist() == [True, False, True] and same.offset[[0, 2]].tolist() == [0, 100]
    assert same.regions == [x] and same.index.tolist() == [0, 0, 0]
    bd = same.blocks(np.array([2, 0], np.intp))
    assert bd.regions == [x] and bd.which.tolist() == [0, 0] and bd.offset.tolist() == [100, 0]
    assert same.blocks(slice(0, 1), np.array([7], np.int64)).offset.tolist() == [7]
    empty = table.resolve(keys[:0], addrs[:0], lengths[:0], Access.REMOTE_READ)
    assert len(empty.ok) == 0 and len(empty.index) == 0
    unknown = table.resolve(keys[[8, 8]], addrs[[8, 8]], lengths[[8, 8]], Access(0))
    assert unknown.ok.tolist() == [False, False]
    # An unknown key or a missing right fails even an empty block at address 0 (where the bounds of
    # "no region", 0 to 0, would hold).
    zero = np.zeros(2, np.uint64)
    assert not table.resolve(np.array([y.lkey + 2, x.lkey], np.uint32), zero, zero, Access(0)).ok[0]
    assert not table.resolve(np.array([y.lkey, x.lkey], np.uint32), zero, zero, Access.REMOTE_WRITE).ok.any()


# -- the copies ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("length", "dst_offsets"),
    [
        (64, [0, 64, 128, 4096 * 8, (1 << 20) - 64]),  # back to back, then apart, the last at the very end
        (64, [320, 0, 64]),  # out of order
        (64, [0, 32, 8]),  # overlapping destinations: the later block wins
        (VECTOR_MAX, [i * VECTOR_MAX for i in (3, 0, 7, 1, 2, 4, 5, 6, 9)]),  # several groups
        (VECTOR_MAX + 1, [0, VECTOR_MAX + 1]),  # one slice copy each
        (1, list(range(0, GROUP_BYTES + 10, 1))),  # more one-byte blocks than a group
    ],
)
def test_copy_between_two_regions_is_the_blocks_one_after_another(length: int, dst_offsets: list[int]) -> None:
    table = MemoryTable()
    size = 1 << 20
    src, dst = register(table, size, seed=1), register(table, size, seed=2)
    rng = np.random.default_rng(3)
    k = len(dst_offsets)
    src_offsets = rng.integers(0, size - length, k).tolist()
    src_offsets[-1] = size - length  # the last block of the source too
    s, d = blocks([src], [0] * k, src_offsets), blocks([dst], [0] * k, dst_offsets)
    lengths = np.full(k, length, np.uint64)
    expected = dst.array.copy()
    one_by_one([src.array], [expected], s, d, lengths)
    before = src.array.copy()
    copy(s, d, lengths)
    assert np.array_equal(dst.array, expected)
    assert np.array_equal(src.array, before)


def test_copy_within_one_region_or_over_several_follows_posting_order() -> None:
    table = MemoryTable()
    r = register(table, 1 << 16, seed=4)
    # Source and destination in one buffer: each block reads what the blocks before it wrote.
    s, d = blocks([r], [0, 0, 0], [0, 64, 128]), blocks([r], [0, 0, 0], [64, 128, 192])
    lengths = np.full(3, 64, np.uint64)
    expected = r.array.copy()
    one_by_one([expected], [expected], s, d, lengths)
    copy(s, d, lengths)
    assert np.array_equal(r.array, expected) and np.array_equal(r.array[192:256], r.array[0:64])
    # Several regions on each side, mixed lengths.
    x, y, z = register(table, 4096, seed=5), register(table, 4096, seed=6), register(table, 4096, seed=7)
    s = blocks([x, y], [1, 0, 1, 0], [10, 20, 30, 4000])
    d = blocks([z, r], [0, 1, 0, 1], [0, 500, 100, 9000])
    lengths = np.array([50, 60, 70, 96], np.uint64)
    want_z, want_r = z.array.copy(), r.array.copy()
    one_by_one([x.array, y.array], [want_z, want_r], s, d, lengths)
    copy(s, d, lengths)
    assert np.array_equal(z.array, want_z) and np.array_equal(r.array, want_r)
    copy(s, d, np.zeros(0, np.uint64))  # nothing
    assert np.array_equal(z.array, want_z)
    # Several regions on one side or both, blocks of one length: each block in its own region.
    for src_regions, dst_regions in (([x, y], [z]), ([x], [z, r]), ([x, y], [z, r])):
        s = blocks(src_regions, [i % len(src_regions) for i in range(4)], [0, 64, 128, 192])
        d = blocks(dst_regions, [i % len(dst_regions) for i in range(4)], [1000, 2000, 3000, 3500])
        lengths = np.full(4, 64, np.uint64)
        want = [reg.array.copy() for reg in dst_regions]
        one_by_one([reg.array for reg in src_regions], want, s, d, lengths)
        copy(s, d, lengths)
        assert all(np.array_equal(reg.array, w) for reg, w in zip(dst_regions, want, strict=True))


def test_a_single_block_and_blocks_of_different_lengths() -> None:
    table = MemoryTable()
    a, b = register(table, 8192, seed=8), register(table, 8192, seed=9)
    s, d = blocks([a], [0], [100]), blocks([b], [0], [7])
    want = b.array.copy()
    want[7:107] = a.array[100:200]
    copy(s, d, np.array([100], np.uint64))
    assert np.array_equal(b.array, want)
    s, d = blocks([a], [0, 0], [0, 1000]), blocks([b], [0, 0], [0, 10])  # the second overwrites part of the first
    lengths = np.array([64, 32], np.uint64)
    want = b.array.copy()
    one_by_one([a.array], [want], s, d, lengths)
    copy(s, d, lengths)
    assert np.array_equal(b.array, want)
    s, d = blocks([a], [0, 0], [0, 64]), blocks([b], [0, 0], [0, 64])  # zero-length blocks copy nothing
    before = b.array.copy()
    copy(s, d, np.zeros(2, np.uint64))
    assert np.array_equal(b.array, before)


# Random lengths as well: a process that already copied blocks of a fixed length (the test run that
# collected the fixed cases, say) has that length's item type made, and would never make one again.
@pytest.mark.parametrize(
    ("length", "k"),
    [(333, 5), (331, GROUP_BYTES // 331 + 3), (4093, 200), (-1, 3), (-2, 3)],
    ids=["333", "331-groups", "4093", "random", "random-again"],
)
def test_copy_equal_moves_every_block(length: int, k: int) -> None:
    if length < 0:  # drawn when the test runs, so fresh in every process (two different ones in one)
        length = (5_000 if length == -1 else 60_000) + secrets.randbelow(50_000)
    rng = np.random.default_rng(10)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    src_off = rng.integers(0, len(src) - length + 1, k).astype(np.intp)
    dst_off = (rng.permutation(len(dst) // length)[:k] * length).astype(np.intp)  # apart from each other
    src_off[0] = len(src) - length  # the very last item of the source
    expected = dst.copy()
    for so, do in zip(src_off.tolist(), dst_off.tolist(), strict=True):
        expected[do : do + length] = src[so : so + length]
    copy_equal(src, src_off, dst, dst_off, length)
    assert np.array_equal(dst, expected)


def test_blocks_are_independent_only_apart_and_in_other_memory() -> None:
    table = MemoryTable()
    buf = np.zeros(3 * 4096, np.uint8)
    a = table.register(memoryview(buf[:4096]), Access.all())
    b = table.register(memoryview(buf[4096:8192]), Access.all())  # right after a
    c = table.register(memoryview(buf[4000:5000]), Access.all())  # overlaps both
    offs = np.array([128, 0, 64], np.int64)
    assert independent(a, b, offs, 64) and independent(b, a, offs, 64)
    assert not independent(a, b, offs, 65)
    assert not independent(a, c, offs, 8) and not independent(c, b, offs, 8) and not independent(c, a, offs, 8)
    assert not independent(a, a, offs, 8)
    assert independent(a, b, np.array([5], np.int64), 4096)
    assert not independent(a, b, np.array([9, 9], np.int64), 1)
    assert not independent(a, b, np.array([0, 100, 110], np.int64), 64)  # only the last two overlap
    assert not independent(a, b, np.array([110, 0, 100, 300], np.int64), 64)
