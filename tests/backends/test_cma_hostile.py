"""A hostile peer of the same user, as a real second process, against what the kernel enforces (issue 23, item 3).

What it cannot do whatever code it runs: write an allocation no region of which is exported with
REMOTE_WRITE, or the region table, through the memfds it is handed (or opens by path); so a revoked
slot stays revoked and an honest peer's stale descriptor fails. (With ptrace permission it could
still write anything by cross-memory attach: docs/backends.md, "What a peer of the same user can do".)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from moriio_async.backends.base import MemoryRegion
from moriio_async.backends.cma import CmaBackend, CmaQueuePair, VendorErr
from moriio_async.backends.cma.initiator import TargetLink
from moriio_async.backends.cma.regions import CmaRegion
from moriio_async.backends.cma.table import LIVE, READ, WRITE
from moriio_async.status import Access, Opcode, WcStatus

from .harness import Pair, PairFactory, random_bytes, statuses
from .test_cma_specific import SLOT_MASK, cma, eventually, line, spawn, tell, to

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.only_backends("cma", reason="a hostile peer against the cma backend's memfds and table"),
]


@contextlib.contextmanager
def hostile_peer(target: CmaBackend) -> Iterator[Any]:
    """A hostile process connected to ``target`` as an initiator (with a passive pair of its own there)."""
    proc = spawn("hostile")
    qp = target.create_qp(target.create_cq(64))
    try:
        qp.connect(line(proc)["endpoint"])
        tell(proc, dict(qp.endpoint()))
        yield proc
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
            assert proc.stderr is not None
            err = proc.stderr.read()
            proc.stderr.close()
            if proc.stdout is not None:
                proc.stdout.close()
        qp.close()
        assert proc.returncode == 0, err


def alloc_of(mr: MemoryRegion) -> int:
    assert isinstance(mr, CmaRegion) and mr.alloc
    return mr.alloc


def link_of(pair: Pair) -> TargetLink:
    qp = pair.a.qp
    assert isinstance(qp, CmaQueuePair) and qp.link is not None
    return qp.link


def wrote(routes: dict[str, str]) -> dict[str, str]:
    return {route: how for route, how in routes.items() if how == "ok"}


def test_a_hostile_peer_cannot_write_an_allocation_exported_read_only(pairs: PairFactory) -> None:
    pair = pairs(1 << 20, 1 << 20)
    target = cma(pair.b.backend)
    mr = target.allocate_memory(1 << 20, Access.LOCAL_WRITE | Access.REMOTE_READ)
    target.export_memory(mr)
    pair.b.regions.append(mr)
    shared = np.frombuffer(mr.view, dtype=np.uint8)
    shared[:] = random_bytes(1 << 20, 3)
    before = shared.copy()
    with hostile_peer(target) as proc:
        tell(proc, {"alloc": alloc_of(mr)})
        got = line(proc)
        tell(proc, {})
    assert got["handed"], "a peer may map a READ allocation (to read it)"
    # mmap for writing, pwrite, mprotect of a read-only mapping, reopening /proc/self/fd/N, a hole punched:
    # the kernel refuses each.
    assert wrote(got["routes"]) == {}, got["routes"]
    assert np.array_equal(shared, before), "the hostile peer wrote a region exported read-only"
    # The owner still writes through its own mapping, and an honest peer still reads through its (read-only) one.
    shared[:4096] = 0x5A
    assert all(wc.ok for wc in pair.run([to(mr, pair, 0, Opcode.RDMA_READ, [(0, 4096)], 0)]))
    assert bool((pair.a.buf[:4096] == 0x5A).all())
    assert alloc_of(mr) in link_of(pair).read_only


def test_a_hostile_peer_cannot_revive_a_revoked_slot_for_an_honest_stale_descriptor(pairs: PairFactory) -> None:
    pair = pairs(1 << 20, 1 << 20)
    target = cma(pair.b.backend)
    stale = pair.b.register(pair.b.buf, Access.all())
    slot = stale.rkey & SLOT_MASK
    with hostile_peer(target) as proc:
        tell(proc, {"alloc": 0})
        assert not line(proc)["handed"]
        pair.b.deregister(stale)  # from its return on, no byte of the region may land
        # Every initiator (the hostile one too) acknowledged: the slot is free, its key gone.
        assert eventually(lambda: int(target.table.records["rkey"][slot]) == 0)
        revived = target.table.records[slot].copy()
        revived["rkey"], revived["flags"] = stale.rkey, LIVE | READ | WRITE
        revived["addr"], revived["length"], revived["alloc"] = stale.addr, stale.length, 0
        order = {"slot": slot, "record": revived.tobytes().hex(), "pid": os.getpid(), "table_fd": target.table.fd}
        tell(proc, order)
        routes = line(proc)["routes"]
        pair.a.buf[:] = 0xAB
        before = pair.b.buf.copy()
        wcs = pair.run([to(stale, pair, 0, Opcode.RDMA_WRITE, [(0, 4096)], 0)], expect=1)
    assert np.array_equal(pair.b.buf, before), "a byte landed after deregister_memory returned"
    assert statuses(wcs) == [WcStatus.REM_ACCESS_ERR]
    assert wcs[0].vendor_err in (VendorErr.UNKNOWN_RKEY, VendorErr.REMOTE_REVOKED)
    assert wrote(routes) == {}, routes  # mmap, pwrite, mprotect, reopen, hole punch, /proc/<target>/fd/N


def test_a_region_exported_for_writing_in_a_sealed_allocation_is_written_by_cross_memory_attach(
    pairs: PairFactory,
) -> None:
    """A READ region seals its allocation: a REMOTE_WRITE region in it is still written (not through the
    read-only mapping, where a store would be SIGSEGV)."""
    pair: Pair = pairs(1 << 20, 1 << 20)
    target = cma(pair.b.backend)
    whole = target.allocate_memory(1 << 20, Access.all())
    target.export_memory(whole)
    pair.b.regions.append(whole)
    reader = target.register_memory(whole.view[:4096], Access.LOCAL_WRITE | Access.REMOTE_READ)  # seals it
    target.export_memory(reader)
    pair.b.regions.append(reader)
    shared = np.frombuffer(whole.view, dtype=np.uint8)
    pair.a.buf[:] = random_bytes(1 << 20, 9)
    wrs = [to(reader, pair, 0, Opcode.RDMA_READ, [(0, 4096)], 0)]
    wrs += [to(whole, pair, 1 + i, Opcode.RDMA_WRITE, [(i * 65536, 65536)], i * 65536) for i in range(16)]
    assert all(wc.ok for wc in pair.run(wrs))
    assert np.array_equal(shared, pair.a.buf)
    assert alloc_of(whole) in link_of(pair).read_only


def test_an_allocation_whose_regions_are_not_exported_is_not_handed_to_a_peer(pairs: PairFactory) -> None:
    """What decides is the export (the table), not the access a region was registered with."""
    pair = pairs(1 << 20, 1 << 20)
    target = cma(pair.b.backend)
    hidden = target.allocate_memory(1 << 20, Access.all())  # registered for remote access, never exported
    pair.b.regions.append(hidden)
    with hostile_peer(target) as proc:
        tell(proc, {"alloc": alloc_of(hidden)})
        got = line(proc)
        tell(proc, {})
    assert not got["handed"], got
