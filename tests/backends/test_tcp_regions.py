"""The TCP backend's region table on its own: registration, exports, the checks a request meets at
either end (key, bounds, access; which block fails first and why), the pins a target's check takes,
and deregistration that aborts the peers holding them.

No sockets: the checks are called as the responder and the sender call them, on the arrays of a
chunk (several blocks) or the plain integers of one request."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest

from moriio_async.backends.tcp import VendorErr
from moriio_async.backends.tcp.regions import ABORT_GRACE, Checked, KeyStream, RegionTable, TcpRegion
from moriio_async.errors import InvalidArgument
from moriio_async.status import Access, Opcode

pytestmark = pytest.mark.timeout(60)

W, R = int(Opcode.RDMA_WRITE), int(Opcode.RDMA_READ)
READ_ONLY = Access.REMOTE_READ
NO_REMOTE_READ = Access.LOCAL_WRITE | Access.REMOTE_WRITE


def arrays(*blocks: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(key, addr, length) triples as the uint32/uint64 columns a chunk carries."""
    keys = np.array([b[0] for b in blocks], dtype=np.uint32)
    addrs = np.array([b[1] for b in blocks], dtype=np.uint64)
    lengths = np.array([b[2] for b in blocks], dtype=np.uint64)
    return keys, addrs, lengths


def table_with(*accesses: Access, size: int = 4096) -> tuple[RegionTable, list[TcpRegion], list[np.ndarray]]:
    table = RegionTable()
    bufs = [np.zeros(size, np.uint8) for _ in accesses]
    regions = [table.register(memoryview(b), a) for b, a in zip(bufs, accesses, strict=True)]
    for r in regions:
        table.export(r)
    return table, regions, bufs


def result(c: Checked) -> tuple[int, VendorErr]:
    return c.first_bad, c.vendor


class Holder:
    """A responder as deregistration sees it: ``abort`` ends its socket call, which then unpins."""

    def __init__(self, region: TcpRegion | None = None) -> None:
        self.region = region
        self.aborts = 0

    def abort(self) -> None:
        self.aborts += 1
        if self.region is not None:  # the socket call returns on another thread, which unpins
            threading.Timer(0.05, self.region.unpin, (self,)).start()


# -- registration and exports ------------------------------------------------------------------------


def test_registration_records_the_buffer_and_its_access() -> None:
    table = RegionTable()
    buf = np.zeros((4, 16), np.uint32)  # 2-D and not bytes: registered as its 256 bytes
    r = table.register(memoryview(buf), Access.LOCAL_WRITE | Access.REMOTE_READ)
    assert (r.addr, r.length) == (buf.ctypes.data, 256)
    assert r.view.format == "B" and r.view.nbytes == 256
    empty = np.zeros(0, np.uint8)
    nothing = table.register(memoryview(empty), Access.LOCAL_WRITE)  # a region of no bytes is allowed
    assert (nothing.addr, nothing.length) == (empty.ctypes.data, 0)
    table.deregister(nothing)
    for other in (np.zeros(64, np.uint32), np.zeros((4, 64), np.uint8), np.zeros(256, np.int8)):  # one differs each
        extra = table.register(memoryview(other), Access.LOCAL_WRITE)
        assert (extra.view.format, extra.view.ndim, extra.view.nbytes) == ("B", 1, 256)
        table.deregister(extra)
    assert (r.can_local_write, r.can_remote_write, r.can_remote_read) == (True, False, True)
    assert r.live and not r.exported and r.lkey != r.rkey and 0 not in (r.lkey, r.rkey)
    assert table.by_lkey == {r.lkey: r} and table.by_rkey == {}
    w = table.register(memoryview(np.zeros(8, np.uint8)), Access.LOCAL_WRITE | Access.REMOTE_WRITE)
    assert (w.can_local_write, w.can_remote_write, w.can_remote_read) == (True, True, False)
    with pytest.raises(InvalidArgument, match=r"^REMOTE_WRITE access needs LOCAL_WRITE too") as refused:
        table.register(memoryview(np.zeros(8, np.uint8)), Access.REMOTE_WRITE | Access.REMOTE_READ)
    assert refused.value.hint == "register with Access.LOCAL_WRITE | REMOTE_WRITE"
    assert len(table.by_lkey) == 2


def test_export_makes_the_rkey_known_once_and_only_for_a_live_region_of_this_table() -> None:
    table, (a, b), _ = table_with(Access.all(), Access.all())
    table.export(a)  # again: no change
    assert table.by_rkey == {a.rkey: a, b.rkey: b} and a.exported
    other = RegionTable().register(memoryview(np.zeros(8, np.uint8)), Access.all())
    table.export(other)  # not this table's region
    assert other.rkey not in table.by_rkey and not other.exported
    gone = table.register(memoryview(np.zeros(8, np.uint8)), Access.all())
    table.deregister(gone)
    table.export(gone)
    assert gone.rkey not in table.by_rkey and not gone.exported


def test_deregistration_forgets_both_keys_kills_the_region_and_is_idempotent() -> None:
    table, (a, b), _ = table_with(Access.all(), Access.all())
    table.deregister(a)
    assert not a.live and b.live
    assert table.by_lkey == {b.lkey: b} and table.by_rkey == {b.rkey: b}
    table.deregister(a)
    foreign = RegionTable().register(memoryview(np.zeros(8, np.uint8)), Access.all())
    table.deregister(foreign)
    assert foreign.live and table.by_lkey == {b.lkey: b}
    table.clear()
    assert not b.live and table.by_lkey == {} and table.by_rkey == {}


def test_the_key_stream_hands_out_its_permutation_of_the_counter_in_order() -> None:
    stream = KeyStream()
    keys = [stream.next() for _ in range(200)]
    assert keys == [k for k in map(stream.permute, range(201)) if k][:200]


def test_the_key_stream_permutes_counters_of_all_32_bits() -> None:
    # Both 16-bit halves of the counter vary (the other test's sample keeps the high half 0).
    xs = [hi << 16 | lo for hi in (*range(128), *range(0xFF80, 0x10000)) for lo in (0, 1, 0x7FFF, 0xFFFF)]
    stream = KeyStream()
    keys = [stream.permute(x) for x in xs]
    assert len(set(keys)) == len(xs) and all(0 <= k < 1 << 32 for k in keys)
    assert max(keys) >= 1 << 31  # the high bit is used


# -- the checks ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("one", [True, False], ids=["one-block", "a-chunk"])
def test_a_remote_check_names_the_first_failing_block_and_why(one: bool) -> None:
    table, (rw, ro), _ = table_with(Access.all(), READ_ONLY)
    a = rw.addr
    cases = [  # (opcode, key, addr, length): (first_bad, vendor) of the block alone
        ((W, rw.rkey, a, 4096), (1, VendorErr.NONE)),
        ((W, rw.rkey, a + 4095, 1), (1, VendorErr.NONE)),
        ((W, rw.rkey, a + 4096, 0), (1, VendorErr.NONE)),
        ((W, rw.rkey, a + 4096, 1), (0, VendorErr.REMOTE_OUT_OF_BOUNDS)),
        ((W, rw.rkey, a - 1, 2), (0, VendorErr.REMOTE_OUT_OF_BOUNDS)),
        ((W, rw.rkey, a + 1, 4096), (0, VendorErr.REMOTE_OUT_OF_BOUNDS)),
        ((W, rw.rkey, a + 8, 2**64 - 4), (0, VendorErr.REMOTE_OUT_OF_BOUNDS)),  # addr + length wraps
        ((W, rw.rkey ^ 0x5A5A5A5A or 1, a, 8), (0, VendorErr.UNKNOWN_RKEY)),
        ((W, ro.rkey, ro.addr, 8), (0, VendorErr.REMOTE_NO_ACCESS)),
        ((R, ro.rkey, ro.addr, 8), (1, VendorErr.NONE)),
        ((W, ro.rkey, ro.addr + 4090, 8), (0, VendorErr.REMOTE_OUT_OF_BOUNDS)),  # bounds before access
        ((W, rw.lkey, a, 8), (0, VendorErr.UNKNOWN_RKEY)),  # an lkey is no rkey
    ]
    good = (rw.rkey, a, 64)
    for (op, key, addr, length), (ok, vendor) in cases:
        if one:
            checked = table.check_remote_one(op, key, addr, length)
            assert result(checked) == (ok, vendor), (op, key, addr - a, length)
            checked.unpin()
            checked = table.check_remote(op, *arrays((key, addr, length)))
            assert result(checked) == (ok, vendor), (op, key, addr - a, length)
        else:  # behind a good block of the same region, and of another
            for before in (good, (ro.rkey, ro.addr, 8)):
                if before[0] == ro.rkey and op == W:
                    continue
                checked = table.check_remote(op, *arrays(before, (key, addr, length)))
                assert result(checked) == (1 + ok, vendor), (op, key, addr - a, length, before)
                checked.unpin()
            continue
        checked.unpin()
    # In a chunk of several blocks, the first bad one counts, with its own reason.
    for (op, key, addr, length), (ok, vendor) in cases:
        if ok or one:
            continue
        for bad_at in range(3):
            blocks = [good, good, good]
            blocks[bad_at] = (key, addr, length)
            if op == R:
                continue
            checked = table.check_remote(op, *arrays(*blocks))
            assert result(checked) == (bad_at, vendor), (key, addr - a, length, bad_at)
            checked.unpin()
    assert rw.pins == ro.pins == 0


def test_a_chunk_over_several_regions_finds_each_block_in_its_own() -> None:
    table, (x, y, z), _ = table_with(Access.all(), Access.all(), NO_REMOTE_READ)
    blocks = [(y.rkey, y.addr + 8, 8), (x.rkey, x.addr, 4096), (y.rkey, y.addr + 4088, 8), (x.rkey, x.addr + 1, 1)]
    checked = table.check_remote(R, *arrays(*blocks))
    assert result(checked) == (4, VendorErr.NONE)
    assert [checked.found[j] for j in checked.which.tolist()] == [y, x, y, x]
    checked.unpin()
    # Each block is checked against its own region's bounds and access.
    for bad in [(y.rkey, y.addr + 4089, 8), (x.rkey, y.addr, 8), (z.rkey, z.addr, 8), (7, x.addr, 8)]:
        for where in (0, 2, 3):
            chunk = list(blocks)
            chunk[where] = bad
            vendor = {
                y.rkey: VendorErr.REMOTE_OUT_OF_BOUNDS,
                x.rkey: VendorErr.REMOTE_OUT_OF_BOUNDS,
                z.rkey: VendorErr.REMOTE_NO_ACCESS,
            }.get(bad[0], VendorErr.UNKNOWN_RKEY)
            checked = table.check_remote(R, *arrays(*chunk))
            assert result(checked) == (where, vendor), (bad, where)
            checked.unpin()
    # Every block under one unknown key.
    unknown = arrays((7, x.addr, 8), (7, x.addr + 8, 8))
    assert result(table.check_remote(R, *unknown)) == (0, VendorErr.UNKNOWN_RKEY)
    assert result(table.check_local(*unknown, write=False)) == (0, VendorErr.UNKNOWN_LKEY)
    assert x.pins == y.pins == z.pins == 0


def test_local_checks_need_local_write_only_where_the_nic_writes() -> None:
    table, (rw, ro), _ = table_with(Access.all(), READ_ONLY)
    for one in (True, False):

        def check(key: int, addr: int, length: int, write: bool, one: bool = one) -> tuple[int, VendorErr]:
            if one:
                return result(table.check_local_one(key, addr, length, write))
            return result(table.check_local(*arrays((key, addr, length), (rw.lkey, rw.addr, 8)), write))

        n = 1 if one else 2
        assert check(ro.lkey, ro.addr, 8, write=False) == (n, VendorErr.NONE)
        assert check(ro.lkey, ro.addr, 8, write=True) == (0, VendorErr.LOCAL_NO_ACCESS)
        assert check(rw.lkey, rw.addr, 4096, write=True) == (n, VendorErr.NONE)
        assert check(rw.lkey, rw.addr + 1, 4096, write=False) == (0, VendorErr.LOCAL_OUT_OF_BOUNDS)
        assert check(rw.rkey, rw.addr, 8, write=False) == (0, VendorErr.UNKNOWN_LKEY)
    assert result(table.check_local(*arrays(), write=True)) == (0, VendorErr.NONE)
    empty = table.check_remote(R, *arrays())
    assert result(empty) == (0, VendorErr.NONE) and empty.found == [] and empty.pinned == []
    ro.kill()  # dead while still in the table (deregistration under way): no longer usable
    assert result(table.check_local_one(ro.lkey, ro.addr, 8, False)) == (0, VendorErr.LOCAL_NO_ACCESS)
    assert result(table.check_local(*arrays((ro.lkey, ro.addr, 8), (ro.lkey, ro.addr, 8)), False)) == (
        0,
        VendorErr.LOCAL_NO_ACCESS,
    )


def test_a_target_check_pins_what_the_blocks_before_the_failure_use() -> None:
    table, (x, y), _ = table_with(Access.all(), Access.all())
    holder = Holder()
    checked = table.check_remote(W, *arrays((x.rkey, x.addr, 8), (y.rkey, y.addr, 8)), holder)
    assert (x.pins, y.pins, x.holders, y.holders) == (1, 1, {holder: 1}, {holder: 1})
    assert checked.holder is holder
    checked.unpin()
    assert (x.pins, y.pins, x.holders, y.holders) == (0, 0, {}, {})
    # y is used only after the failing block: not pinned.
    checked = table.check_remote(W, *arrays((x.rkey, x.addr, 8), (x.rkey, x.addr + 4096, 8), (y.rkey, y.addr, 8)))
    assert result(checked) == (1, VendorErr.REMOTE_OUT_OF_BOUNDS)
    assert (x.pins, y.pins) == (1, 0) and checked.pinned == [x]
    assert [(checked.found[j], r) for j, r in checked.used()] == [(x, x)]
    checked.unpin()
    assert checked.pinned == [] and x.pins == 0
    # Nothing before a failure at the first block: nothing pinned.
    checked = table.check_remote_one(W, x.rkey, x.addr + 4096, 8, holder)
    assert (x.pins, checked.pinned) == (0, [])
    assert checked.used() == []
    checked = table.check_remote_one(W, y.rkey, y.addr, 8, holder)
    assert checked.used() == [(0, y)] and checked.pinned == [y] and y.holders == {holder: 1}
    checked.unpin()
    assert y.holders == {} and y.pins == 0
    checked = table.check_remote(W, *arrays((y.rkey, y.addr, 8), (y.rkey, y.addr + 8, 8)))
    assert checked.used() == [(0, y)] and checked.pinned == [y] and y.pins == 1
    checked.unpin()


def test_a_region_dying_between_lookup_and_pin_fails_its_first_block_as_deregistered() -> None:
    table, (x, y, z), _ = table_with(Access.all(), Access.all(), Access.all())
    y.kill()  # still in the table: deregistration has marked it dead, not yet dropped its keys
    checked = table.check_remote_one(W, y.rkey, y.addr, 8)
    assert result(checked) == (0, VendorErr.REMOTE_DEREGISTERED) and y.pins == 0
    checked = table.check_remote(W, *arrays((y.rkey, y.addr, 8), (y.rkey, y.addr + 8, 8)))
    assert result(checked) == (0, VendorErr.REMOTE_DEREGISTERED) and checked.pinned == []
    blocks = [(x.rkey, x.addr, 8), (z.rkey, z.addr, 8), (y.rkey, y.addr, 8), (z.rkey, z.addr + 8, 8)]
    checked = table.check_remote(W, *arrays(*blocks))
    assert result(checked) == (2, VendorErr.REMOTE_DEREGISTERED)
    assert (x.pins, y.pins, z.pins) == (1, 0, 1)
    checked.unpin()
    # Dead before the blocks of a region only later blocks use: those are unpinned again.
    holder = Holder()
    blocks = [(x.rkey, x.addr, 8), (y.rkey, y.addr, 8), (z.rkey, z.addr, 8)]
    checked = table.check_remote(W, *arrays(*blocks), holder)
    assert result(checked) == (1, VendorErr.REMOTE_DEREGISTERED)
    assert (x.pins, y.pins, z.pins) == (1, 0, 0) and checked.pinned == [x]
    assert (x.holders, z.holders) == ({holder: 1}, {})
    checked.unpin()
    # Two regions, the dead one first used by the second block.
    checked = table.check_remote(W, *arrays((x.rkey, x.addr, 8), (y.rkey, y.addr, 8), (x.rkey, x.addr + 8, 8)))
    assert result(checked) == (1, VendorErr.REMOTE_DEREGISTERED) and checked.pinned == [x]
    checked.unpin()
    # A later failure stays where it is when the dead region is used after it.
    blocks = [(x.rkey, x.addr, 8), (x.rkey, x.addr + 4096, 8), (y.rkey, y.addr, 8)]
    checked = table.check_remote(W, *arrays(*blocks))
    assert result(checked) == (1, VendorErr.REMOTE_OUT_OF_BOUNDS) and x.pins == 1
    checked.unpin()
    assert x.pins == y.pins == z.pins == 0


# -- pins and deregistration -------------------------------------------------------------------------


def test_pins_count_per_holder() -> None:
    table, (r,), _ = table_with(Access.all())
    a, b = Holder(), Holder()
    assert r.pin(a) and r.pin(a) and r.pin(b) and r.pin()
    assert (r.pins, r.holders) == (4, {a: 2, b: 1})
    r.unpin(a)
    assert (r.pins, r.holders) == (3, {a: 1, b: 1})
    r.unpin(a)
    r.unpin()
    assert (r.pins, r.holders) == (1, {b: 1})
    r.unpin(b)
    assert (r.pins, r.holders) == (0, {})
    table.deregister(r)
    assert not r.pin(a) and r.pins == 0 and r.holders == {}


def test_deregistration_aborts_the_holders_and_returns_once_they_unpinned() -> None:
    table, (r,), _ = table_with(Access.all())
    holder = Holder(r)
    assert r.pin(holder) and r.pin(holder)
    threading.Timer(0.05, r.unpin, (holder,)).start()  # the second pin's call ends by itself
    started = time.monotonic()
    table.deregister(r)
    assert r.pins == 0 and holder.aborts == 1 and r.drained.is_set()
    assert time.monotonic() - started < ABORT_GRACE


def test_deregistration_waits_for_a_pin_without_holder_and_aborts_no_one() -> None:
    table, (r,), _ = table_with(Access.all())
    peer = Holder()
    assert r.pin()
    r.unpin()  # an earlier call, ended while the region was live
    assert r.pin() and r.pin(peer)
    done = threading.Event()
    t = threading.Thread(target=lambda: (table.deregister(r), done.set()))
    t.start()
    time.sleep(0.1)
    assert peer.aborts == 1 and not done.is_set()
    r.unpin(peer)
    time.sleep(0.1)
    assert not done.is_set(), "returned while the initiator's own call still held the buffer"
    r.unpin()
    t.join(5)
    assert done.is_set() and r.pins == 0


def test_an_aborted_call_that_does_not_return_is_logged_and_still_waited_for(caplog: pytest.LogCaptureFixture) -> None:
    table, (r,), _ = table_with(Access.all())
    stuck = Holder()  # its abort ends nothing: the call keeps the pin
    assert r.pin(stuck)
    done = threading.Event()
    with caplog.at_level(logging.WARNING, logger="moriio_async.tcp"):
        # daemon, and unpinned whatever the assertions say: a failure here must not leave a thread that keeps
        # the test process from exiting
        t = threading.Thread(target=lambda: (table.deregister(r), done.set()), daemon=True)
        t.start()
        try:
            time.sleep(ABORT_GRACE + 0.5)
            assert not done.is_set()
            messages = [rec.getMessage() for rec in caplog.records if rec.name == "moriio_async.tcp"]
            assert messages == [f"tcp region {r.addr:#x}: aborted socket calls still hold it after {ABORT_GRACE:g}s"]
        finally:
            r.unpin(stuck)
            t.join(5)
    assert done.is_set() and stuck.aborts == 1
