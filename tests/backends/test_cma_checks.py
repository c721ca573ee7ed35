"""The cma checks' shortcuts for a batch under one key (one record read, four reductions) agree with
the per-range checks they stand in for, on random and hostile input."""

from __future__ import annotations

import numpy as np
import pytest

from moriio_async.backends.cma.table import LIVE, READ, WRITE, RegionTable, TableView, first_outside
from moriio_async.backends.cma.wire import VendorErr

pytestmark = pytest.mark.only_backends("cma", reason="unit tests of the cma backend's checks")

BASE = 1 << 40
SIZE = 1 << 20
EDGES = [0, 1, BASE - 1, BASE, BASE + 1, BASE + SIZE - 1, BASE + SIZE, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]


def elementwise(addrs: np.ndarray, lengths: np.ndarray, base: int, size: int) -> int:
    for i, (a, n) in enumerate(zip(addrs.tolist(), lengths.tolist(), strict=True)):
        if not (base <= a and a + n <= base + size):
            return i
    return len(addrs)


def ranges(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Mostly inside the region, with now and then an edge value (wrapping sums included)."""
    addrs = rng.integers(BASE, BASE + SIZE, n, dtype=np.uint64)
    lengths = rng.integers(0, 4096, n, dtype=np.uint64)
    for _ in range(rng.integers(0, 3)):
        i = int(rng.integers(0, n))
        if rng.random() < 0.5:
            addrs[i] = np.uint64(EDGES[int(rng.integers(0, len(EDGES)))])
        else:
            lengths[i] = np.uint64(EDGES[int(rng.integers(0, len(EDGES)))])
    return addrs, lengths


def test_first_outside_finds_the_first_range_outside_the_region(backend_name: str) -> None:
    rng = np.random.default_rng(26)
    for trial in range(3000):
        addrs, lengths = ranges(rng, int(rng.integers(1, 40)))
        assert first_outside(addrs, lengths, BASE, SIZE) == elementwise(addrs, lengths, BASE, SIZE), trial


@pytest.mark.parametrize("write", [False, True])
def test_the_one_key_table_check_agrees_with_the_per_range_check(backend_name: str, write: bool) -> None:
    table = RegionTable()
    view = TableView(table.fd)
    try:
        keys = {
            "rw": table.publish(BASE, SIZE, LIVE | READ | WRITE),
            "read only": table.publish(BASE, SIZE, LIVE | READ),
            "no access": table.publish(BASE, SIZE, LIVE),
            "revoked": table.publish(BASE, SIZE, LIVE | READ | WRITE),
        }
        table.revoke(keys["revoked"])
        keys["unknown"] = keys["rw"] ^ (1 << 16)
        rng = np.random.default_rng(7)
        for name, key in keys.items():
            for trial in range(300):
                addrs, lengths = ranges(rng, int(rng.integers(1, 40)))
                rkeys = np.full(len(addrs), key, dtype=np.uint32)
                one = view.check(rkeys, addrs, lengths, write, one_key=True)
                general = view.check(rkeys, addrs, lengths, write)
                assert (one.first_bad, one.vendor) == (general.first_bad, general.vendor), (name, trial)
                assert one.one is not None  # the shortcut read the one record, for all the ranges
    finally:
        view.close()
        table.close()


# Ranges that touch the region's ends are inside, one byte more is not: (address, length) pairs and the
# index of the first outside. The random ranges above rarely hit these exact edges.
EDGE_CASES = [
    ([(BASE + SIZE, 0), (BASE + SIZE, 1)], 1),
    ([(BASE, SIZE), (BASE - 1, 1)], 1),
    ([(BASE + SIZE - 1, 1), (BASE + SIZE - 1, 2)], 1),
    ([(BASE, 0), (BASE + 1, SIZE)], 1),
]


@pytest.mark.parametrize(("ranges_", "first_bad"), EDGE_CASES)
def test_ranges_touching_the_region_s_ends_are_inside_and_one_byte_more_is_not(
    backend_name: str, ranges_: list[tuple[int, int]], first_bad: int
) -> None:
    addrs = np.array([a for a, _ in ranges_], np.uint64)
    lengths = np.array([n for _, n in ranges_], np.uint64)
    assert first_outside(addrs, lengths, BASE, SIZE) == first_bad
    table = RegionTable()
    view = TableView(table.fd)
    try:
        one = table.publish(BASE, SIZE, LIVE | READ)
        other = table.publish(BASE, SIZE, LIVE | READ)
        for rkeys, one_key in (([one, one], True), ([one, one], False), ([one, other], False)):
            checked = view.check(np.array(rkeys, np.uint32), addrs, lengths, write=False, one_key=one_key)
            assert (checked.first_bad, checked.vendor) == (first_bad, VendorErr.REMOTE_OUT_OF_BOUNDS), rkeys
    finally:
        view.close()
        table.close()


def test_a_region_above_2_63_still_contains_its_ranges(backend_name: str) -> None:
    # Where the shortcut's uint64 sums could wrap, the per-element path answers: all inside is their count.
    base = (1 << 63) + (1 << 40)
    addrs = np.array([base, base + 4096, base + SIZE - 1], np.uint64)
    lengths = np.array([4096, SIZE - 4096, 1], np.uint64)
    assert first_outside(addrs, lengths, base, SIZE) == 3
    assert first_outside(addrs, lengths + np.uint64(1), base, SIZE) == 1
