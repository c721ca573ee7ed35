"""Local scatter-entry checks before posting: plain Python and numpy, no pyverbs (so the host tests run them).

Why the backend checks local entries itself: rxe reports a bad lkey on a WRITE
as LOC_QP_OP_ERR after moving the packets before it; checked here, a request
that would fail locally never reaches the wire and fails LOC_PROT_ERR, in
order, with nothing moved.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ...status import Access, Opcode
from ...work import WorkBatch

if TYPE_CHECKING:
    from .memory import VerbsMemoryRegion

__all__ = ["covers", "first_bad_local"]


def covers(region: VerbsMemoryRegion, addr: int, length: int, *, write: bool) -> bool:
    """Whether a local SGE lies inside the live region and, for a READ's target, may be written."""
    if region.handle is None or addr < region.addr or addr + length > region.addr + region.length:
        return False
    return not write or bool(region.access & Access.LOCAL_WRITE)


def first_bad_local(batch: WorkBatch, regions: Callable[[int], VerbsMemoryRegion | None]) -> int | None:
    """The index of the first request with a scatter entry outside its live local region (or, for a
    READ, in a region without LOCAL_WRITE); None when every entry is fine.

    Vectorised over the batch: one pass per distinct lkey (a batch has one, as a rule).
    Every request has at least one entry (the caller checked). The usual case (one
    lkey, every entry inside) costs a handful of array reductions: under emulation
    each numpy call costs 100-300 us, so the count matters more than the work.
    """
    keys = batch.sge_lkey
    if len(batch) == 1 and len(keys) == 1:  # a single read or write: no arrays
        region = regions(int(keys[0]))
        write = int(batch.opcode[0]) == Opcode.RDMA_READ
        fine = region is not None and covers(region, int(batch.sge_addr[0]), int(batch.sge_length[0]), write=write)
        return None if fine else 0
    addr, length = batch.sge_addr, batch.sge_length
    first = int(keys[0])
    if int(keys.min()) == first == int(keys.max()):
        region = regions(first)
        if (
            region is not None
            and region.handle is not None
            and int(addr.min()) >= region.addr
            and int((addr + length).max()) <= region.addr + region.length
            and (region.access & Access.LOCAL_WRITE or not bool((batch.opcode == Opcode.RDMA_READ).any()))
        ):
            return None  # all fine; otherwise find the first bad request below
    return _first_bad(batch, regions)


def _first_bad(batch: WorkBatch, regions: Callable[[int], VerbsMemoryRegion | None]) -> int | None:
    """``first_bad_local`` entry by entry (vectorised): which request is the first bad one."""
    keys, addr, length = batch.sge_lkey, batch.sge_addr, batch.sge_length
    reads = np.repeat(batch.opcode == Opcode.RDMA_READ, np.diff(batch.sge_start))
    first = int(keys[0])
    distinct = [first] if bool((keys == first).all()) else np.unique(keys).tolist()
    ok = np.zeros(len(keys), dtype=np.bool_)
    for key in distinct:
        region = regions(key)
        if region is None or region.handle is None:
            continue
        inside = (addr >= region.addr) & (addr + length <= region.addr + region.length)
        if not region.access & Access.LOCAL_WRITE:
            inside &= ~reads
        if len(distinct) == 1:
            ok = inside
        else:
            mine = keys == key
            ok[mine] = inside[mine]
    per_request = np.logical_and.reduceat(ok, batch.sge_start[:-1])
    return None if bool(per_request.all()) else int(np.argmin(per_request))
