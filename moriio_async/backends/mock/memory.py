"""The mock's registered memory: a key table, checks over whole arrays of addresses, and array copies.

A chunk of work requests is checked with a handful of numpy operations
(``resolve``: key to region, bounds, access, for every SGE or remote range at
once) and its bytes move with ``copy``: one fancy-indexed gather/scatter per
group of equal-length blocks when nothing overlaps, one slice assignment per
block otherwise, always in posting order where order can matter.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import as_strided

from ...errors import InvalidArgument
from ...status import Access
from ..base import MemoryRegion

__all__ = ["VECTOR_MAX", "Blocks", "MemoryTable", "MockRegion", "Resolved", "copy", "copy_equal", "independent"]

U8 = npt.NDArray[np.uint8]
U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]

VECTOR_MAX = 64 << 10
"""Blocks up to this size move in gathered groups; larger ones one slice copy each (the copy dominates)."""
GROUP_BYTES = 256 << 10
"""Bytes per gather/scatter group: the temporary stays in cache."""


@dataclass(eq=False, slots=True)
class MockRegion(MemoryRegion):
    """A registered buffer and a uint8 array over it."""

    array: U8 = field(default_factory=lambda: np.zeros(0, np.uint8), repr=False)


class Blocks(NamedTuple):
    """Block ``i`` is at ``offset[i]`` of ``regions[which[i]]``."""

    regions: list[MockRegion]
    which: npt.NDArray[np.intp]
    offset: I64


@dataclass(frozen=True, slots=True)
class Resolved:
    """Where each of ``n`` (key, addr, length) triples points: ``ok``, its region, its offset in it."""

    ok: Bools
    index: npt.NDArray[np.intp]
    offset: I64
    regions: list[MockRegion]

    def blocks(self, select: slice | npt.NDArray[np.intp], offset: I64 | None = None) -> Blocks:
        """The ``select``ed entries as blocks (``offset`` instead of their own offsets, if given)."""
        return Blocks(self.regions, self.index[select], self.offset[select] if offset is None else offset)


class MemoryTable:
    """Regions by key (lkey == rkey here); keys are never reused, so a stale key never hits a new region."""

    def __init__(self) -> None:
        self._regions: dict[int, MockRegion] = {}
        # key -> (region, first address, end address, access bits as a plain int): the checks on
        # every post read these without touching the IntFlag (whose ``&`` is a Python call).
        self._bounds: dict[int, tuple[MockRegion, int, int, int]] = {}
        self._used: set[int] = set()

    def register(self, buffer: memoryview, access: Access) -> MockRegion:
        if access & Access.REMOTE_WRITE and not access & Access.LOCAL_WRITE:
            # ibv_reg_mr refuses this (EINVAL); refusing it here too keeps the backends alike.
            raise InvalidArgument(
                "REMOTE_WRITE access needs LOCAL_WRITE too", hint="register with Access.LOCAL_WRITE | REMOTE_WRITE"
            )
        array = np.frombuffer(buffer, dtype=np.uint8)
        key = secrets.randbits(31) | 1
        while key in self._used:
            key = secrets.randbits(31) | 1
        self._used.add(key)
        region = MockRegion(int(array.ctypes.data), array.nbytes, key, key, access, array.data, array)
        self._regions[key] = region
        self._bounds[key] = (region, region.addr, region.addr + region.length, int(access))
        return region

    def deregister(self, region: MemoryRegion) -> None:
        if self._regions.get(region.lkey) is region:
            del self._regions[region.lkey]
            del self._bounds[region.lkey]

    def clear(self) -> None:
        self._regions.clear()
        self._bounds.clear()

    def lookup(self, key: int, addr: int, length: int, need: int) -> MockRegion | None:
        """``resolve`` for one block, on plain integers: its region, or None when a check fails."""
        entry = self._bounds.get(key)
        if entry is None:
            return None
        region, start, end, bits = entry
        if bits & need != need or not (start <= addr and length >= 0 and addr + length <= end):
            return None
        return region

    def usable(self, key: int, need: int) -> tuple[MockRegion, int, int] | None:
        """The live region under ``key`` if it grants ``need``: (region, first address, end address)."""
        entry = self._bounds.get(key)
        if entry is None or entry[3] & need != need:
            return None
        return entry[0], entry[1], entry[2]

    def resolve(self, keys: npt.NDArray[np.uint32], addrs: U64, lengths: U64, need: Access) -> Resolved:
        """Check every triple at once: a live region under the key, ``[addr, addr + length)`` inside
        it, and the access ``need``."""
        n = len(keys)
        if n == 0 or bool((keys == keys[0]).all()):
            uniq: list[int] = [int(keys[0])] if n else []
            index = np.zeros(n, dtype=np.intp)
        else:
            u, index = np.unique(keys, return_inverse=True)
            uniq = u.tolist()
        found = [self._regions.get(k) for k in uniq]
        usable = [r is not None and (r.access & need) == need for r in found]
        base = np.array([r.addr if r is not None and u else 0 for r, u in zip(found, usable, strict=True)], np.uint64)
        end = np.array(
            [r.addr + r.length if r is not None and u else 0 for r, u in zip(found, usable, strict=True)], np.uint64
        )
        b, e = base[index], end[index]
        # Written so that a huge addr or length cannot wrap around into range: addr <= end first.
        ok = np.array(usable, dtype=np.bool_)[index]
        ok &= (addrs >= b) & (addrs <= e)
        ok &= lengths <= np.where(addrs <= e, e - addrs, 0)
        offset = (addrs - b).astype(np.int64)
        regions = [r if r is not None else _NO_REGION for r in found]
        return Resolved(ok, index, offset, regions)


_NO_REGION = MockRegion(0, 0, 0, 0, Access(0), memoryview(b""), np.zeros(0, np.uint8))


def copy(src: Blocks, dst: Blocks, lengths: U64) -> None:
    """Copy block ``i`` of ``src`` to block ``i`` of ``dst`` (``lengths[i]`` bytes), for every ``i``,
    as if one after another. Every block was checked already."""
    k = len(lengths)
    if k == 0:
        return
    if k > 1 and len(src.regions) == 1 and len(dst.regions) == 1:
        length = int(lengths[0])
        if 0 < length <= VECTOR_MAX and bool((lengths == length).all()):
            s, d = src.regions[0], dst.regions[0]
            if independent(s, d, dst.offset, length):
                s2, d2 = _windows(s.array, length), _windows(d.array, length)
                group = max(1, GROUP_BYTES // length)
                for g in range(0, k, group):
                    d2[dst.offset[g : g + group]] = s2[src.offset[g : g + group]]
                return
    sarrays = [r.array for r in src.regions]
    darrays = [r.array for r in dst.regions]
    for si, so, di, do, n in zip(
        src.which.tolist(), src.offset.tolist(), dst.which.tolist(), dst.offset.tolist(), lengths.tolist(), strict=True
    ):
        darrays[di][do : do + n] = sarrays[si][so : so + n]


_ITEMS: dict[int, np.dtype[np.void]] = {}


def copy_equal(src: U8, src_off: npt.NDArray[np.intp], dst: U8, dst_off: npt.NDArray[np.intp], length: int) -> None:
    """Copy ``length`` bytes from each ``src_off[i]`` of ``src`` to ``dst_off[i]`` of ``dst``, as if one
    after another. The caller checked every block and that order cannot matter (``independent``).

    Each array is seen as overlapping ``length``-byte items, one starting at every byte, so a block
    is one item and a group of blocks moves with one gather and one scatter (each item one memcpy).
    """
    item = _ITEMS.get(length)
    if item is None:
        item = _ITEMS.setdefault(length, np.dtype((np.void, length)))
    s = np.ndarray((len(src) - length + 1,), dtype=item, buffer=src, strides=(1,))
    d = np.ndarray((len(dst) - length + 1,), dtype=item, buffer=dst, strides=(1,))
    k = len(src_off)
    group = max(1, GROUP_BYTES // length)
    if k <= group:
        d[dst_off] = s[src_off]
        return
    for g in range(0, k, group):
        d[dst_off[g : g + group]] = s[src_off[g : g + group]]


def _windows(array: U8, length: int) -> U8:
    """Every ``length``-byte window of ``array`` as a row (a view: row ``o`` starts at byte ``o``)."""
    return as_strided(array, shape=(len(array) - length + 1, length), strides=(1, 1))


def independent(src: MockRegion, dst: MockRegion, dst_off: npt.NDArray[np.intp] | I64, length: int) -> bool:
    """True when copying the blocks in any order gives what copying them in order would:
    the destination blocks do not overlap each other, and no source byte is a destination byte."""
    if src.addr < dst.addr + dst.length and dst.addr < src.addr + src.length:
        return False
    starts = np.sort(dst_off)
    return bool(np.logical_and.reduce(np.subtract(starts[1:], starts[:-1]) >= length))
