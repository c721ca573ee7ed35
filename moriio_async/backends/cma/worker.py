"""The initiator's worker: posted requests executed in order, a chunk at a time, checks before bytes.

The thread that executes is the pair's worker, or the posting thread itself
(``execute``) when it posted a small batch to an idle pair: then no thread
is woken to move the bytes, and none is woken to learn they moved. One
thread at a time executes (``PairState.running``); a chunk that would wait
on the target (a shared allocation to map first) is left to the worker.

A chunk (consecutive requests of one opcode, about ``round_bytes`` of
payload, at most IOV_MAX requests and SGEs) runs in windows of at most
``round_bytes`` (a huge request is several windows). Each window, under the
pair's ``copy_lock``:

1. the local SGEs are checked against this backend's regions, and the remote
   ranges against the target's shared table (rkey, range, access, revoked),
   with a few array operations for the whole chunk;
2. the bytes of the requests before the first failure move: with
   ``process_vm_readv``/``writev`` (one call per IOV_MAX rows, partial
   transfers resumed), or, where the target region lies in a shared
   allocation this pair has mapped, with ``memmove``; split over the mover's
   threads when large.

So a request that fails a check moves no byte, and a revocation applied by
the reader (under the same lock) is seen by every later window. Allocations
are mapped before the lock is taken, since that waits on the target.
"""

from __future__ import annotations

import errno

import numpy as np
import numpy.typing as npt

from ...status import Opcode, WcStatus
from ...work import WorkBatch
from ..base import QpState
from .initiator import TargetLink
from .inuse import tag_for
from .iov import Iov, Mover, iovecs, window
from .pairstate import PairState
from .regions import LocalTable
from .table import Record, first_outside
from .wire import VendorErr

__all__ = ["HANDOFF", "Executor", "execute", "work_loop"]

_READ = int(Opcode.RDMA_READ)
_RTS = QpState.RTS

U64 = npt.NDArray[np.uint64]
Outcome = tuple[int, WcStatus | None, int]
"""How many requests from the chunk's first succeeded, then the failure's status (None: none) and vendor code
(``HANDOFF`` with no status: the rest of the chunk needs a wait on the target, which only the worker makes)."""
HANDOFF = -1


def _errno_outcome(err: int) -> tuple[WcStatus, VendorErr]:
    if err == errno.ESRCH:
        return WcStatus.RETRY_EXC_ERR, VendorErr.PEER_EXITED
    if err == errno.EFAULT:
        return WcStatus.REM_ACCESS_ERR, VendorErr.REMOTE_FAULT
    if err == errno.EPERM:
        return WcStatus.REM_OP_ERR, VendorErr.NOT_PERMITTED
    return WcStatus.GENERAL_ERR, VendorErr.NONE


class Executor:
    """Runs chunks of one queue pair against one target."""

    def __init__(self, st: PairState, link: TargetLink, local: LocalTable, mover: Mover, round_bytes: int,
                 timeout: float) -> None:  # fmt: skip
        self.st = st
        self.link = link
        self.local = local
        self.mover = mover
        self.round_bytes = round_bytes
        self.timeout = timeout
        self.missing = 0
        """The allocation ``_plan`` found unmapped at the head of the chunk."""

    def run(self, batch: WorkBatch, lo: int, hi: int, may_wait: bool = True) -> Outcome:
        read = batch.opcode.item(lo) == _READ
        ra, rl, rk = batch.remote_addr[lo:hi], batch.length[lo:hi], batch.rkey[lo:hi]
        link, st, inuse = self.link, self.st, self.link.inuse
        ends = np.cumsum(rl)
        a, b = int(batch.sge_start[lo]), int(batch.sge_start[hi])
        local_all = iovecs(batch.sge_addr[a:b], batch.sge_length[a:b])
        pos = unmapped = 0
        key = rk.item(0)
        one_key = hi - lo == 1 or bool((rk == key).all())  # a session's batch: one remote region
        tag = (key & 0xFFFF) + 1 if one_key else tag_for(rk & np.uint32(0xFFFF))
        while True:
            if link.gone or link.exited():
                vendor_gone = VendorErr.PEER_EXITED if link.exited() else link.gone_vendor
                return int(np.searchsorted(ends, pos, side="right")), WcStatus.RETRY_EXC_ERR, vendor_gone
            with st.copy_lock:
                # Announce the window's target slots before its checks; clear the word after its copy.
                inuse.enter(tag)
                try:
                    if st.state != _RTS:
                        return 0, None, 0  # flushed meanwhile: the worker sees ERR next
                    end_req, status, vendor, remote = self._plan(batch, lo, hi, read, a, b, one_key)
                    if vendor == VendorErr.NO_MAPPING and not end_req:
                        unmapped = self.missing
                        end_req = -1
                    movable = int(ends[end_req - 1]) if end_req > 0 else 0
                    stop = min(movable, pos + self.round_bytes)
                    if stop > pos:
                        rio = remote if remote is not None else iovecs(ra, rl)
                        whole = pos == 0 and stop == int(ends[-1]) and len(rio) == hi - lo
                        lw, rw = (local_all, rio) if whole else (window(local_all, pos, stop), window(rio, pos, stop))
                        moved, err = self.mover.move(link.pid, remote is not None, not read, lw, rw, stop - pos)
                        pos += moved
                        if err:
                            failed = int(np.searchsorted(ends, pos, side="right"))
                            st_, vendor_ = _errno_outcome(err)
                            if st_ is WcStatus.RETRY_EXC_ERR or link.exited():
                                return failed, WcStatus.RETRY_EXC_ERR, VendorErr.PEER_EXITED
                            return failed, st_, vendor_
                finally:
                    inuse.leave()
            if end_req < 0:  # map the target's allocation (this waits on it: not under the lock), then retry
                if not may_wait:
                    return int(np.searchsorted(ends, pos, side="right")), None, HANDOFF
                if not link.map(unmapped, st, self.timeout):
                    return int(np.searchsorted(ends, pos, side="right")), WcStatus.REM_ACCESS_ERR, VendorErr.NO_MAPPING
                continue
            if pos >= movable:
                return end_req, status, vendor

    def _plan(
        self, batch: WorkBatch, lo: int, hi: int, read: bool, a: int, b: int, one_key: bool = False
    ) -> tuple[int, WcStatus | None, int, Iov | None]:
        """Check the chunk now: how many requests may move, the failure after them (None: a kind
        boundary or nothing), and, where the target's regions are mapped here, the remote iovecs
        as local addresses (None: cross-memory attach)."""
        n = hi - lo
        starts = batch.sge_start
        nloc, lvendor = self.local.check(batch.sge_lkey[a:b], batch.sge_addr[a:b], batch.sge_length[a:b], write=read)
        lbad = n if nloc >= b - a else int(np.searchsorted(starts[lo : hi + 1], a + nloc, side="right")) - 1
        rk, ra, rl = batch.rkey[lo:hi], batch.remote_addr[lo:hi], batch.length[lo:hi]
        rc = self.link.view.check(rk, ra, rl, write=not read, one_key=one_key)
        good = min(lbad, rc.first_bad)
        status: WcStatus | None = None
        vendor = 0
        if good < n:
            if lbad <= rc.first_bad:
                status, vendor = WcStatus.LOC_PROT_ERR, lvendor
            elif rc.vendor == VendorErr.PEER_CLOSED:  # the target closed its backend: as if it had exited
                status, vendor = WcStatus.RETRY_EXC_ERR, rc.vendor
            else:
                status, vendor = WcStatus.REM_ACCESS_ERR, rc.vendor
        if not good:
            return 0, status, vendor, None
        if rc.one is not None:
            return self._plan_one(rc.one, ra[:good], rl[:good], read, good, status, vendor)
        allocs = rc.records["alloc"][:good]
        read_only = self.link.read_only
        if not read and read_only:
            # An allocation sealed against writes is mapped read-only here: a region in it exported
            # with REMOTE_WRITE is written by cross-memory attach, as if it were plain memory.
            allocs = np.where(np.isin(allocs, np.fromiter(read_only, np.uint32)), np.uint32(0), allocs)
        shared = bool(allocs[0])
        kind_change = np.flatnonzero((allocs != 0) != shared)
        if len(kind_change):  # one kind per window: the rest runs next
            good, status, vendor = int(kind_change[0]), None, 0
        if not shared:
            return good, status, vendor, None
        recs, allocs = rc.records[:good], allocs[:good]
        maps = self.link.maps
        base = np.zeros(good, dtype=np.uint64)
        size = np.zeros(good, dtype=np.uint64)
        for alloc_id in np.unique(allocs).tolist():
            mapped = maps.get(alloc_id)
            if mapped is None:
                missing = int(np.argmax(allocs == alloc_id))
                if missing == 0:
                    self.missing = alloc_id
                    return 0, WcStatus.REM_ACCESS_ERR, VendorErr.NO_MAPPING, None
                good, status, vendor = missing, None, 0
                recs, allocs, base, size = recs[:good], allocs[:good], base[:good], size[:good]
                continue
            sel = allocs == alloc_id
            base[sel], size[sel] = mapped
        offset = recs["alloc_off"] + (ra[:good] - recs["addr"])
        inside = (offset <= size) & (rl[:good] <= size - offset)
        if not bool(inside.all()):
            bad = int(np.argmin(inside))
            good, status, vendor = bad, WcStatus.REM_ACCESS_ERR, VendorErr.REMOTE_OUT_OF_BOUNDS
            if not good:
                return 0, status, vendor, None
            base, offset = base[:good], offset[:good]
        return good, status, vendor, iovecs(base + offset, rl[:good])

    def _plan_one(
        self,
        rec: Record,
        ra: U64,
        rl: U64,
        read: bool,
        good: int,
        status: WcStatus | None,
        vendor: int,
    ) -> tuple[int, WcStatus | None, int, Iov | None]:
        """``_plan``'s rest when every request named one region (record ``rec``): one allocation or none."""
        alloc_id, addr, alloc_off = rec[2], rec[4], rec[6]
        if not alloc_id or (not read and alloc_id in self.link.read_only):
            return good, status, vendor, None  # plain memory (or sealed against writes): cross-memory attach
        mapped = self.link.maps.get(alloc_id)
        if mapped is None:
            self.missing = alloc_id
            return 0, WcStatus.REM_ACCESS_ERR, VendorErr.NO_MAPPING, None
        base, size = mapped
        # The allocation starts at ``addr - alloc_off`` in the target; each range must lie in the part of
        # it mapped here (the table check put it inside the region; a table can lie about alloc_off).
        start = addr - alloc_off
        bad = first_outside(ra, rl, start, size) if start >= 0 else 0
        if bad < good:
            good, status, vendor = bad, WcStatus.REM_ACCESS_ERR, VendorErr.REMOTE_OUT_OF_BOUNDS
            if not good:
                return 0, status, vendor, None
            ra, rl = ra[:good], rl[:good]
        return good, status, vendor, iovecs(ra + np.uint64((base - start) % (1 << 64)), rl)  # wraps as uint64


def work_loop(st: PairState, ex: Executor) -> None:
    """Execute what is posted, oldest first, until the pair leaves RTS (the worker thread)."""
    while True:
        with st.lock:
            while st.state == _RTS and (st.running or not st.pending):
                st.work_cv.wait()
            if st.state != _RTS:
                return
            st.running = True
        execute(st, ex)


def execute(st: PairState, ex: Executor, may_wait: bool = True) -> None:
    """Execute head chunks until nothing is queued or the pair fails; the caller set ``running``, which
    this clears. ``may_wait=False`` (a poster, on the event loop): a chunk that would wait on the target
    is left, from there on, to the worker."""
    try:
        while True:
            with st.lock:
                span = st.take_head_locked()
                if span is None:
                    return
                lo = span.pos
                hi = span.next_chunk(ex.round_bytes)
            done, status, vendor = ex.run(span.batch, lo, hi, may_wait)
            with st.lock:
                if st.state != _RTS:
                    return
                st.complete_locked(span, done)
                if vendor == HANDOFF:
                    return
                if status is not None:
                    st.fail_locked(status, vendor)
                    return
    finally:
        with st.lock:
            st.stop_running_locked()
