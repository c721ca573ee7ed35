"""The work batches a channel's jobs hand out are well formed: every request column holds one entry per
request, every scatter column one per entry, with the dtypes the backends read (they take the arrays
as they are: a column longer than the batch would be read past the batch by a vectorised check)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from moriio_async.aio.channel import Job
from moriio_async.aio.transfer import Transfer
from moriio_async.core.plan import Plan
from moriio_async.status import Opcode
from moriio_async.work import WorkBatch

REQUEST_COLUMNS = {"opcode": np.uint8, "remote_addr": np.uint64, "rkey": np.uint32, "length": np.uint64}
ENTRY_COLUMNS = {"sge_addr": np.uint64, "sge_length": np.uint64, "sge_lkey": np.uint32}


def transfer() -> Transfer:
    return Transfer(asyncio.get_running_loop(), 1, Opcode.RDMA_WRITE, "b", (0,), (0,), (8,))


def check(batch: WorkBatch, n: int, entries: int) -> None:
    assert len(batch) == n
    for name, dtype in REQUEST_COLUMNS.items():
        column = getattr(batch, name)
        assert (column.shape, column.dtype) == ((n,), dtype), name
    assert batch.signaled.shape == (n,) and batch.signaled.dtype == np.dtype(np.bool_)
    assert (batch.sge_start.shape, int(batch.sge_start[0]), int(batch.sge_start[-1])) == ((n + 1,), 0, entries)
    for name, dtype in ENTRY_COLUMNS.items():
        column = getattr(batch, name)
        assert (column.shape, column.dtype) == ((entries,), dtype), name


@pytest.mark.parametrize("opcode", [Opcode.RDMA_READ, Opcode.RDMA_WRITE])
@pytest.mark.parametrize("cached", [False, True])
async def test_a_single_jobs_batch_is_one_request_in_every_column(opcode: Opcode, cached: bool) -> None:
    if cached:  # the second job under the same keys takes them from the cache
        Job.single(transfer(), opcode, local_addr=1, lkey=11, remote_addr=2, rkey=12, size=3)
    job = Job.single(transfer(), opcode, local_addr=1, lkey=11, remote_addr=2, rkey=12, size=3)
    batch = job.chunk(0, 1, 5, np.array([True]))
    check(batch, 1, 1)
    assert (batch.wr_id, int(batch.rkey[0]), int(batch.sge_lkey[0])) == (5, 12, 11)


async def test_a_planned_jobs_chunks_are_well_formed() -> None:
    plan = Plan(
        np.array([0, 100, 200], dtype=np.int64),
        np.array([10, 20, 5], dtype=np.int64),
        np.array([0, 1, 3, 4], dtype=np.int64),
        np.array([0, 50, 60, 90], dtype=np.int64),
        np.array([10, 5, 15, 5], dtype=np.int64),
    )
    job = Job(transfer(), plan, Opcode.RDMA_WRITE, local_addr=1000, lkey=7, remote_addr=5000, rkey=9)
    check(job.chunk(1, 3, 8, np.array([False, True])), 2, 3)
    check(job.chunk(0, 1, 7, np.array([False])), 1, 1)
    check(job.chunk(0, 3, 1, np.array([False, False, True])), 3, 4)
