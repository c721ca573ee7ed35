"""This backend's own memory: registered regions by lkey, and shared-memory allocations.

``allocate`` makes a buffer backed by a sealed memfd; a region registered
inside one records which allocation it lies in and where, so a peer can map
the same pages and copy with ``memmove`` instead of cross-memory attach.
An allocation lives as long as its buffer object does (a ``weakref``
finalizer closes the memfd); peers keep their own mappings until the regions
they use are revoked.

Read-only is the kernel's to enforce, not the peer's: an allocation is
sealed against writes (``F_SEAL_FUTURE_WRITE``: the owner's own mapping keeps
writing, no other descriptor or mapping ever can) as soon as a region
without REMOTE_WRITE is registered in it, or when it is handed to a peer
while no region in it is exported with REMOTE_WRITE. A read-only descriptor
alone would not do: a peer reopens ``/proc/self/fd/N`` read-write. Peers map
a sealed allocation read-only; a region in it exported with REMOTE_WRITE is
then written by cross-memory attach, never through the mapping.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import threading
import weakref
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from ...errors import InvalidArgument
from ...status import Access
from ..base import MemoryRegion
from ..soft.pair import address_of
from .table import LIVE, READ, WRITE, first_outside, seal_fd, seal_writes
from .wire import VendorErr

__all__ = ["Allocation", "CmaRegion", "LocalTable", "address_of", "table_flags"]

U32 = npt.NDArray[np.uint32]
U64 = npt.NDArray[np.uint64]
MAX_ALLOCATION = 1 << 40


@dataclass(eq=False, slots=True)
class CmaRegion(MemoryRegion):
    """A registered buffer; ``alloc`` is its shared-memory allocation's id (0: plain memory)."""

    alloc: int = 0
    alloc_off: int = 0
    live: bool = True
    local_write: bool = False
    acks: set[object] = field(default_factory=set, repr=False)
    """Target side: the connections that have yet to acknowledge this region's revocation."""


@dataclass(eq=False, slots=True)
class Allocation:
    """A memfd-backed buffer of this process: its id, descriptor, size and address."""

    id: int
    fd: int
    size: int
    addr: int
    sealed: bool = False
    """Sealed against writes: peers map it read-only, and no one ever maps it writable again."""


class LocalTable:
    """Regions by lkey, allocations by id. Lookups are lock-free dict reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.by_lkey: dict[int, CmaRegion] = {}
        self.allocations: dict[int, Allocation] = {}
        self._lkeys = itertools.count(1)
        self._ids = itertools.count(1)

    def allocate(self, size: int) -> mmap.mmap:
        """A zeroed, page-aligned buffer of ``size`` bytes backed by a sealed memfd."""
        if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= MAX_ALLOCATION:
            raise InvalidArgument(f"allocation size must be an int in 1..{MAX_ALLOCATION}, not {size!r}")
        fd = os.memfd_create("moriio-cma-buffer", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            seal_fd(fd)  # a peer's mapping can never fault: the file cannot shrink
            buffer = mmap.mmap(fd, size)
            with contextlib.suppress(OSError, AttributeError):
                buffer.madvise(mmap.MADV_HUGEPAGE)  # used where shmem huge pages are allowed (see kernel.py)
        except BaseException:
            os.close(fd)
            raise
        view = memoryview(buffer)
        try:
            addr = address_of(view)
        finally:
            view.release()
        with self._lock:
            alloc = Allocation(next(self._ids), fd, size, addr)
            self.allocations[alloc.id] = alloc
        weakref.finalize(buffer, self._forget, alloc.id)
        return buffer

    def _forget(self, alloc_id: int) -> None:
        with self._lock:
            alloc = self.allocations.pop(alloc_id, None)
        if alloc is not None:
            os.close(alloc.fd)

    def containing(self, addr: int, length: int) -> Allocation | None:
        with self._lock:
            for alloc in self.allocations.values():
                if alloc.addr <= addr and addr + length <= alloc.addr + alloc.size:
                    return alloc
        return None

    def seal(self, alloc: Allocation) -> bool:
        """Seal ``alloc`` against writes (once and for good); False where the kernel cannot."""
        with self._lock:
            if not alloc.sealed and self.allocations.get(alloc.id) is alloc:
                try:
                    seal_writes(alloc.fd)
                except OSError:
                    return False
                alloc.sealed = True
            return alloc.sealed

    def register(self, buffer: memoryview, access: Access) -> CmaRegion:
        view = buffer if buffer.format == "B" and buffer.ndim == 1 else buffer.cast("B")
        if access & Access.REMOTE_WRITE and not access & Access.LOCAL_WRITE:
            # ibv_reg_mr refuses this (EINVAL); refusing it here too keeps the backends alike.
            raise InvalidArgument(
                "REMOTE_WRITE access needs LOCAL_WRITE too", hint="register with Access.LOCAL_WRITE | REMOTE_WRITE"
            )
        addr = address_of(view)
        alloc = self.containing(addr, view.nbytes)
        if alloc is not None and not access & Access.REMOTE_WRITE:
            self.seal(alloc)  # no peer is to write this: from now on none can through the memfd (best effort)
        with self._lock:
            lkey = next(self._lkeys) & 0xFFFFFFFF
            region = CmaRegion(
                addr=addr, length=view.nbytes, lkey=lkey, rkey=0, access=access, view=view,
                alloc=0 if alloc is None else alloc.id, alloc_off=0 if alloc is None else addr - alloc.addr,
                local_write=bool(access & Access.LOCAL_WRITE),
            )  # fmt: skip
            self.by_lkey[lkey] = region
        return region

    def remove(self, region: MemoryRegion) -> CmaRegion | None:
        """Forget the region's lkey; the region, or None when it was not registered here (idempotent)."""
        with self._lock:
            found = self.by_lkey.get(region.lkey)
            if found is not region:
                return None
            del self.by_lkey[region.lkey]
            found.live = False
            return found

    def clear(self) -> list[CmaRegion]:
        with self._lock:
            regions = list(self.by_lkey.values())
            self.by_lkey.clear()
            for r in regions:
                r.live = False
            allocs = list(self.allocations.values())
            self.allocations.clear()
        for alloc in allocs:
            os.close(alloc.fd)
        return regions

    def check(self, lkeys: U32, addrs: U64, lengths: U64, write: bool) -> tuple[int, VendorErr]:
        """Local SGEs: the first that fails (their count when none does) and why."""
        n = len(lkeys)
        if n == 1:
            return self.check_one(lkeys.item(0), addrs.item(0), lengths.item(0), write)
        if not n:
            return 0, VendorErr.NONE
        if bool((lkeys == lkeys[0]).all()):  # one region (the usual case): no np.unique
            region = self.by_lkey.get(lkeys.item(0))
            if region is None or not region.live:
                return 0, VendorErr.UNKNOWN_LKEY
            if write and not region.local_write:
                return 0, VendorErr.LOCAL_NO_ACCESS
            bad = first_outside(addrs, lengths, region.addr, region.length)
            return bad, VendorErr.NONE if bad == n else VendorErr.LOCAL_OUT_OF_BOUNDS
        uniq, which = np.unique(lkeys, return_inverse=True)
        found = [self.by_lkey.get(k) for k in uniq.tolist()]
        codes = [
            VendorErr.UNKNOWN_LKEY if r is None or not r.live
            else VendorErr.LOCAL_NO_ACCESS if write and not r.local_write else VendorErr.NONE
            for r in found
        ]  # fmt: skip
        base = np.array([0 if r is None else r.addr for r in found], dtype=np.uint64)[which]
        size = np.array([0 if r is None else r.length for r in found], dtype=np.uint64)[which]
        offset = addrs - base
        inside = (addrs >= base) & (offset <= size) & (lengths <= size - offset)
        good = np.array([c == VendorErr.NONE for c in codes], dtype=np.bool_)[which] & inside
        if bool(good.all()):
            return n, VendorErr.NONE
        bad = int(np.argmin(good))
        code = codes[int(which[bad])]
        return bad, code if code != VendorErr.NONE else VendorErr.LOCAL_OUT_OF_BOUNDS

    def check_one(self, lkey: int, addr: int, length: int, write: bool) -> tuple[int, VendorErr]:
        region = self.by_lkey.get(lkey)
        if region is None or not region.live:
            return 0, VendorErr.UNKNOWN_LKEY
        if not (region.addr <= addr and addr + length <= region.addr + region.length):
            return 0, VendorErr.LOCAL_OUT_OF_BOUNDS
        if write and not region.local_write:
            return 0, VendorErr.LOCAL_NO_ACCESS
        return 1, VendorErr.NONE


def table_flags(access: Access) -> int:
    """The table's access bits for a region registered with ``access``."""
    return LIVE | (READ if access & Access.REMOTE_READ else 0) | (WRITE if access & Access.REMOTE_WRITE else 0)
