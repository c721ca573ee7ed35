"""Pieces the software NICs (the TCP and CMA backends) share: the checks a post makes on a batch's
shape, the folding of a run of successes into completions for its signaled requests, and a
registered buffer's address.

Both NICs complete in posting order and push only signaled requests' completions, each carrying
the send-queue slots it frees: itself, and the unsignaled successes before it that no completion
covered yet (``uncovered``), as a verbs CQE covers the unsignaled WRs before it.
"""

from __future__ import annotations

import ctypes

import numpy as np

from ...errors import InvalidArgument
from ...status import Opcode, WcStatus
from ...work import WorkBatch, WorkCompletion

__all__ = ["Completions", "address_of", "check_shape", "fold_successes"]

Completions = list[tuple[WorkCompletion, int]]
"""Completions with the slots each frees once polled."""

_WRITE = int(Opcode.RDMA_WRITE)
_READ = int(Opcode.RDMA_READ)
_OPCODES = {int(o): o for o in Opcode}
_SUCCESS = WcStatus.SUCCESS


def check_shape(batch: WorkBatch, max_sge: int, qp_num: int) -> bool:
    """What a post refuses before anything is admitted: an opcode other than RDMA READ and WRITE,
    and a request with more than ``max_sge`` scatter entries. Raises InvalidArgument. True when
    every request has the same opcode (as a transfer's batch does)."""
    n = len(batch)
    if not n:
        return True
    ops, starts = batch.opcode, batch.sge_start
    first = ops.item(0)
    if n == 1:  # the single read or write: plain integers, no array work
        uniform = True
        most = int(starts[1]) - int(starts[0])
    else:
        uniform = bool((ops == first).all())
        if not uniform and not bool(((ops == _WRITE) | (ops == _READ)).all()):
            raise InvalidArgument(f"unsupported opcode {int(ops[(ops != _WRITE) & (ops != _READ)][0])}")
        most = int(starts[n]) - int(starts[0])  # every request's entries at most: all of them
        if most > max_sge:
            most = int((starts[1 : n + 1] - starts[:n]).max())
    if uniform and first != _WRITE and first != _READ:
        raise InvalidArgument(f"unsupported opcode {first}")
    if most > max_sge:
        raise InvalidArgument(f"{most} SGEs, qp {qp_num} takes at most {max_sge}")
    return uniform


def fold_successes(batch: WorkBatch, a: int, b: int, uncovered: int, qp_num: int) -> tuple[Completions, int]:
    """Requests ``a:b`` of ``batch`` succeeded, in order, after ``uncovered`` successes no completion
    covered yet: a completion for each signaled one (O(signaled), not O(requests)), each with the
    slots it frees, and the successes left uncovered after them."""
    if b - a == 1:
        if not batch.signaled.item(a):
            return [], uncovered + 1
        signaled = [a]
    else:
        signaled = (np.flatnonzero(batch.signaled[a:b]) + a).tolist()
        if not signaled:
            return [], uncovered + b - a
    out: Completions = []
    prev = a - 1 - uncovered
    ops, lengths, first = batch.opcode, batch.length, batch.wr_id
    for i in signaled:
        out.append((WorkCompletion(first + i, _SUCCESS, _OPCODES[ops.item(i)], lengths.item(i), qp_num), i - prev))
        prev = i
    return out, b - 1 - prev


def address_of(view: memoryview) -> int:
    """The buffer's address (the ctypes object, and its export, are dropped at once)."""
    return ctypes.addressof((ctypes.c_char * 0).from_buffer(view))
