"""What a mock queue pair's chunk does to memory: checks against both memory tables, then array copies.

A chunk of one opcode runs here, handed the initiator's and the target's
``MemoryTable``: the usual shape (one scatter entry per request, one key per
side, one block length) in a dozen array operations, anything else the long
way, which finds the first failing request and copies only the requests
before it. A short batch (``FEW`` requests or fewer, any opcodes) runs
request by request on integers instead. The queue pair (``qp.py``) owns order, slots and completions.
"""

from __future__ import annotations

import numpy as np

from ...status import Access, Opcode, WcStatus
from ...work import WorkBatch
from .memory import VECTOR_MAX, MemoryTable, copy, copy_equal, independent

__all__ = ["FEW", "execute", "execute_few", "execute_uniform"]

_READ = int(Opcode.RDMA_READ)
FEW = 8
"""Batches of up to this many requests run one request at a time on integers (``execute_few``):
below that, the vectorised checks cost more than they save."""
# ufunc reductions called directly: ndarray.all()/max()/min() go through Python wrappers that cost
# more than the work on a chunk's few hundred entries.
_ALL, _MAX, _MIN, _SUB = np.logical_and.reduce, np.maximum.reduce, np.minimum.reduce, np.subtract
_NEED_READ_LOCAL, _NEED_WRITE_LOCAL = int(Access.LOCAL_WRITE), 0
_NEED_READ_REMOTE, _NEED_WRITE_REMOTE = int(Access.REMOTE_READ), int(Access.REMOTE_WRITE)


def execute(
    local_table: MemoryTable, batch: WorkBatch, lo: int, hi: int, remote: MemoryTable
) -> tuple[int, WcStatus | None]:
    """Check requests ``lo:hi`` (one opcode) and copy those before the first failure; return
    how many ran and the failure's status (None: all ran)."""
    if execute_uniform(local_table, batch, lo, hi, remote):
        return hi - lo, None
    read = int(batch.opcode[lo]) == _READ
    starts = batch.sge_start
    a, b = int(starts[lo]), int(starts[hi])
    k = hi - lo
    local = local_table.resolve(
        batch.sge_lkey[a:b], batch.sge_addr[a:b], batch.sge_length[a:b], Access.LOCAL_WRITE if read else Access(0)
    )
    far = remote.resolve(
        batch.rkey[lo:hi],
        batch.remote_addr[lo:hi],
        batch.length[lo:hi],
        Access.REMOTE_READ if read else Access.REMOTE_WRITE,
    )
    owner = np.repeat(np.arange(k), np.diff(starts[lo : hi + 1]))  # the request of each SGE
    bad_local = owner[~local.ok]
    first_local = int(bad_local[0]) if len(bad_local) else k
    bad_remote = np.flatnonzero(~far.ok)
    first_remote = int(bad_remote[0]) if len(bad_remote) else k
    done = min(first_local, first_remote)
    status = None if done == k else WcStatus.LOC_PROT_ERR if first_local == done else WcStatus.REM_ACCESS_ERR
    if done:
        e = int(starts[lo + done]) - a  # the SGEs of the requests that run
        owner = owner[:e]
        lengths = batch.sge_length[a : a + e]
        prefix = np.zeros(e + 1, dtype=np.uint64)
        np.cumsum(lengths, out=prefix[1:])
        # Each SGE's place in its request's remote range: bytes before it in the same request.
        within = (prefix[:-1] - prefix[starts[lo : lo + done] - a][owner]).astype(np.int64)
        mine, theirs = local.blocks(slice(0, e)), far.blocks(owner, far.offset[owner] + within)
        if read:
            copy(theirs, mine, lengths)
        else:
            copy(mine, theirs, lengths)
    return done, status


def execute_uniform(local_table: MemoryTable, batch: WorkBatch, lo: int, hi: int, remote: MemoryTable) -> bool:
    """The usual chunk, in a dozen array operations: one scatter entry per request, one key and
    one block length on each side, every block inside its region, order irrelevant. Copies and
    returns True if the chunk is that; returns False, having done nothing, for anything else
    (``execute``'s general path then finds the first failing request)."""
    starts = batch.sge_start
    a, b = int(starts[lo]), int(starts[hi])
    k = hi - lo
    if b - a != k or k < 2:
        return False
    lkeys, rkeys = batch.sge_lkey[a:b], batch.rkey[lo:hi]
    lk, rk = int(lkeys[0]), int(rkeys[0])
    laddr, lens, raddr = batch.sge_addr[a:b], batch.sge_length[a:b], batch.remote_addr[lo:hi]
    length = int(lens[0])
    if not 0 < length <= VECTOR_MAX:
        return False
    # k requests holding k entries are one entry each only if no request holds none.
    same = _SUB(starts[lo + 1 : hi + 1], starts[lo:hi]) == 1
    same &= lens == length
    same &= batch.length[lo:hi] == length
    same &= lkeys == lk
    same &= rkeys == rk
    if not bool(_ALL(same)):
        return False
    read = int(batch.opcode[lo]) == _READ
    mine = local_table.usable(lk, _NEED_READ_LOCAL if read else _NEED_WRITE_LOCAL)
    theirs = remote.usable(rk, _NEED_READ_REMOTE if read else _NEED_WRITE_REMOTE)
    if mine is None or theirs is None:
        return False
    (lreg, lstart, lend), (rreg, rstart, rend) = mine, theirs
    # Bounds: every block starts at or after its region and ends by its end (Python ints: no wrap).
    if int(_MIN(laddr)) < lstart or int(_MAX(laddr)) + length > lend:
        return False
    if int(_MIN(raddr)) < rstart or int(_MAX(raddr)) + length > rend:
        return False
    # Offsets below 2**63 read the same as signed: a view, and fancy indexing takes intp at full speed.
    loff = (laddr - np.uint64(lstart)).view(np.intp)
    roff = (raddr - np.uint64(rstart)).view(np.intp)
    if read:
        if not independent(rreg, lreg, loff, length):
            return False
        copy_equal(rreg.array, roff, lreg.array, loff, length)
    else:
        if not independent(lreg, rreg, roff, length):
            return False
        copy_equal(lreg.array, loff, rreg.array, roff, length)
    return True


def execute_few(local_table: MemoryTable, batch: WorkBatch, remote: MemoryTable) -> tuple[int, WcStatus | None]:
    """Check and copy the requests of a short batch (any opcodes) one by one, on plain integers, up to
    the first that fails; return how many ran and the failure's status (None: all ran)."""
    ops, starts = batch.opcode.tolist(), batch.sge_start.tolist()
    addrs, lengths, lkeys = batch.sge_addr.tolist(), batch.sge_length.tolist(), batch.sge_lkey.tolist()
    raddrs, rkeys, totals = batch.remote_addr.tolist(), batch.rkey.tolist(), batch.length.tolist()
    lookup, far_lookup = local_table.lookup, remote.lookup
    for i, op in enumerate(ops):
        read = op == _READ
        a, b = starts[i], starts[i + 1]
        need = _NEED_READ_LOCAL if read else _NEED_WRITE_LOCAL
        local = [lookup(lkeys[j], addrs[j], lengths[j], need) for j in range(a, b)]
        if None in local:
            return i, WcStatus.LOC_PROT_ERR
        raddr = raddrs[i]
        far = far_lookup(rkeys[i], raddr, totals[i], _NEED_READ_REMOTE if read else _NEED_WRITE_REMOTE)
        if far is None:
            return i, WcStatus.REM_ACCESS_ERR
        pos = raddr - far.addr
        for region, j in zip(local, range(a, b), strict=True):
            assert region is not None
            n = lengths[j]
            off = addrs[j] - region.addr
            if read:
                region.view[off : off + n] = far.view[pos : pos + n]
            else:
                far.view[pos : pos + n] = region.view[off : off + n]
            pos += n
    return len(ops), None
