"""``aio.channel``: what a single-request job shares with the other jobs of its session, and what a
fresh channel reports. A session posts every single read or write under the same pair of keys, so
its jobs share one pair of one-element key arrays, made once; shared, they must not be writable (a
backend or hook writing one would change the keys of every later job of the session)."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from moriio_async.aio.channel import ChannelState, Job, QpChannel
from moriio_async.aio.transfer import Transfer
from moriio_async.status import Opcode
from moriio_async.work import WorkBatch


class FakeQP:
    qp_num = 5
    max_send_wr = 4
    max_sge = 4

    def post(self, batch: WorkBatch) -> None:
        pass

    def to_error(self) -> None:
        pass


def transfer() -> Transfer:
    return Transfer(asyncio.get_running_loop(), 1, Opcode.RDMA_WRITE, "b", (0,), (0,), (8,))


def batch(rkey: int, lkey: int, opcode: Opcode = Opcode.RDMA_WRITE) -> WorkBatch:
    job = Job.single(transfer(), opcode, local_addr=64, lkey=lkey, remote_addr=128, rkey=rkey, size=8)
    return job.chunk(0, 1, 1, np.array([True]))


@pytest.mark.parametrize("opcode", [Opcode.RDMA_READ, Opcode.RDMA_WRITE])
async def test_single_jobs_of_one_session_share_their_key_arrays(opcode: Opcode) -> None:
    first, second = batch(40001, 40002, opcode), batch(40001, 40002, opcode)
    assert np.shares_memory(first.rkey, second.rkey) and np.shares_memory(first.sge_lkey, second.sge_lkey)
    assert (int(second.rkey[0]), int(second.sge_lkey[0])) == (40001, 40002)
    other = batch(40003, 40002, opcode)  # another session's keys: arrays of their own
    assert not np.shares_memory(first.rkey, other.rkey)
    assert (int(other.rkey[0]), int(other.sge_lkey[0])) == (40003, 40002)


@pytest.mark.parametrize("cached", [False, True])
async def test_a_single_jobs_shared_columns_are_read_only(cached: bool) -> None:
    # Keys no other process used: a process forked from one that ran this test before (mutmut's
    # workers are) must still make its own key arrays, not find the parent's in the cache.
    rkey, lkey = 2 * os.getpid() + cached, 2**31 + os.getpid()
    if cached:
        batch(rkey, lkey)
    b = batch(rkey, lkey)
    for column in (b.rkey, b.sge_lkey, b.opcode, b.sge_start):
        with pytest.raises(ValueError, match="read-only"):
            column[0] = 3
    assert (int(b.rkey[0]), int(b.sge_lkey[0]), int(b.opcode[0])) == (rkey, lkey, int(Opcode.RDMA_WRITE))
    again = batch(rkey, lkey)
    assert (int(again.rkey[0]), int(again.sge_lkey[0])) == (rkey, lkey)


async def test_a_fresh_channel_has_posted_nothing() -> None:
    ch = QpChannel(FakeQP())  # type: ignore[arg-type]
    assert (ch.posted, ch.max_in_flight, ch.in_flight, ch.waiting, ch.idle, ch.state) == (
        0,
        0,
        0,
        0,
        True,
        ChannelState.READY,
    )
