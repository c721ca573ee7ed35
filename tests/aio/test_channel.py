"""``aio.channel`` on its own, over a fake queue pair: the work requests a job posts (addresses, keys,
numbering, signaling), backpressure, how completions settle transfers (the vendor error only on the
named request), failure, flush, abort, replacement and the idle wait; the batches a job hands out (a
column per request field and per scatter field, each with one entry per request or entry, in the
dtypes the backends read), and the read-only key arrays a session's single jobs share."""

from __future__ import annotations

import asyncio
import itertools
import os
from typing import Any

import numpy as np
import pytest

from moriio_async.aio.channel import ChannelState, Job, QpChannel, cached_key_pairs
from moriio_async.aio.transfer import Transfer
from moriio_async.backends.base import QueuePair
from moriio_async.core.plan import Plan
from moriio_async.status import Opcode, StatusCode, WcStatus
from moriio_async.work import Sge, WorkBatch, WorkCompletion, WorkRequest


class FakeQP:
    def __init__(self, qp_num: int = 77, depth: int = 4) -> None:
        self.qp_num = qp_num
        self.max_send_wr = depth
        self.max_sge = 4
        self.gathers_singles = False
        self.posts: list[list[WorkRequest]] = []
        self.errors = 0

    def post(self, batch: WorkBatch) -> None:
        self.posts.append(batch.requests())

    post_one = QueuePair.post_one  # the contract's default: post of the one-request batch

    def to_error(self) -> None:
        self.errors += 1

    @property
    def requests(self) -> list[WorkRequest]:
        return [r for p in self.posts for r in p]


def transfer(tid: int = 1) -> Transfer:
    return Transfer(asyncio.get_running_loop(), tid, Opcode.RDMA_WRITE, "b", (0,), (0,), (8,))


def single(t: Transfer, opcode: Opcode = Opcode.RDMA_WRITE, size: int = 8) -> Job:
    return Job.single(t, opcode, local_addr=1000, lkey=7, remote_addr=5000, rkey=9, size=size)


def many(t: Transfer, n: int) -> Job:
    plan = Plan(
        np.arange(n, dtype=np.int64) * 100,
        np.full(n, 10, dtype=np.int64),
        np.arange(n + 1, dtype=np.int64),
        np.arange(n, dtype=np.int64) * 10,
        np.full(n, 10, dtype=np.int64),
    )
    return Job(t, plan, Opcode.RDMA_WRITE, local_addr=1000, lkey=7, remote_addr=5000, rkey=9)


def wc(wr_id: int, status: WcStatus = WcStatus.SUCCESS, vendor_err: int = 0, qp_num: int = 77) -> WorkCompletion:
    return WorkCompletion(wr_id, status, Opcode.RDMA_WRITE, 0, qp_num, vendor_err)


def make(depth: int = 4, gathers: bool = False, **kw: Any) -> tuple[QpChannel, FakeQP]:
    qp = FakeQP(depth=depth)
    qp.gathers_singles = gathers
    return QpChannel(qp, **kw), qp  # type: ignore[arg-type]


async def test_a_planned_job_posts_absolute_addresses_and_keys() -> None:
    t = transfer()
    plan = Plan(
        np.array([0, 100], dtype=np.int64),
        np.array([10, 20], dtype=np.int64),
        np.array([0, 1, 3], dtype=np.int64),
        np.array([0, 50, 60], dtype=np.int64),
        np.array([10, 5, 15], dtype=np.int64),
    )
    job = Job(t, plan, Opcode.RDMA_READ, local_addr=1000, lkey=7, remote_addr=5000, rkey=9)
    assert len(job) == 2 and job.transfer is t
    whole = job.chunk(0, 2, 30, np.array([False, True]))
    assert whole.requests() == [
        WorkRequest(30, Opcode.RDMA_READ, (Sge(1000, 10, 7),), 5000, 9, False),
        WorkRequest(31, Opcode.RDMA_READ, (Sge(1050, 5, 7), Sge(1060, 15, 7)), 5100, 9, True),
    ]
    job = Job(t, plan, Opcode.RDMA_WRITE, local_addr=1000, lkey=7, remote_addr=5000, rkey=9)
    tail = job.chunk(1, 2, 40, np.array([True]))
    assert tail.requests() == [
        WorkRequest(40, Opcode.RDMA_WRITE, (Sge(1050, 5, 7), Sge(1060, 15, 7)), 5100, 9, True),
    ]
    head = job.chunk(0, 1, 41, np.array([False]))
    assert head.requests() == [WorkRequest(41, Opcode.RDMA_WRITE, (Sge(1000, 10, 7),), 5000, 9, False)]


@pytest.mark.parametrize("opcode", list(Opcode))
async def test_a_single_job_is_one_request_with_one_entry(opcode: Opcode) -> None:
    job = single(transfer(), opcode, size=64)
    assert len(job) == 1
    assert job.chunk(0, 1, 3, np.array([True])).requests() == [
        WorkRequest(3, opcode, (Sge(1000, 64, 7),), 5000, 9, True)
    ]
    other = Job.single(transfer(), opcode, local_addr=1, lkey=7, remote_addr=2, rkey=9, size=3)  # cached keys
    assert other.chunk(0, 1, 4, np.array([False])).requests() == [WorkRequest(4, opcode, (Sge(1, 3, 7),), 2, 9, False)]


_FRESH_RKEYS = itertools.count(1 << 31, 2048)  # each run of the test below takes rkeys no other run took


async def test_the_key_cache_is_bounded() -> None:
    base = next(_FRESH_RKEYS)
    expected = cached_key_pairs()  # other tests (and other runs of this one) leave pairs in it
    sizes = []
    for k in range(1100):
        job = Job.single(transfer(), Opcode.RDMA_WRITE, local_addr=0, lkey=k, remote_addr=0, rkey=base + k, size=1)
        assert job.chunk(0, 1, 1, np.array([True])).requests()[0].rkey == base + k
        sizes.append(cached_key_pairs())
        expected = 1 if expected >= 1024 else expected + 1  # a full cache is emptied before the new pair
        assert sizes[-1] == expected
    assert max(sizes) == 1024  # 1100 new pairs fill it from any start


async def test_a_single_transfer_goes_straight_to_the_nic() -> None:
    posts: list[int] = []
    ch, qp = make(on_post=lambda: posts.append(1))
    assert (ch.qp_num, ch.state, ch.in_flight, ch.waiting, ch.idle) == (77, ChannelState.READY, 0, 0, True)
    t = transfer()
    ch.submit(single(t))
    assert t.code is StatusCode.IN_PROGRESS
    assert qp.requests == [WorkRequest(1, Opcode.RDMA_WRITE, (Sge(1000, 8, 7),), 5000, 9, True)]
    assert (ch.posted, ch.max_in_flight, ch.in_flight, ch.waiting, ch.idle, len(posts)) == (1, 1, 1, 0, False, 1)
    ch.on_completion(wc(1))
    assert t.Succeeded() and ch.idle and ch.in_flight == 0


async def test_a_full_queue_holds_requests_until_completions_free_slots() -> None:
    posts: list[int] = []
    ch, qp = make(depth=2, on_post=lambda: posts.append(1))
    ts = [transfer(i) for i in range(4)]
    for t in ts:
        ch.submit(single(t))
    assert (ch.posted, ch.in_flight, ch.waiting, ch.max_in_flight, len(posts)) == (2, 2, 2, 2, 2)
    assert all(t.code is StatusCode.IN_PROGRESS for t in ts)
    ch.on_completion(wc(1))
    assert ts[0].Succeeded() and not ts[1].done()
    assert [r.wr_id for r in qp.requests] == [1, 2, 3]
    assert (ch.posted, ch.in_flight, ch.waiting, ch.max_in_flight, len(posts)) == (3, 2, 1, 2, 3)
    ch.account(wc(3))  # covers 2 and 3; posts nothing until resume
    assert ts[1].Succeeded() and ts[2].Succeeded()
    assert (ch.posted, ch.waiting) == (3, 1)
    ch.resume()
    assert (ch.posted, ch.waiting, ch.in_flight) == (4, 0, 1)
    ch.resume()  # nothing waits: posts nothing
    assert len(posts) == 4
    ch.on_completion(wc(4))
    assert ts[3].Succeeded() and ch.idle


async def test_a_long_job_streams_in_chunks_with_periodic_signals() -> None:
    ch, qp = make(depth=8)  # a signal every 2 requests
    t = transfer()
    ch.submit(many(t, 11))
    assert [r.signaled for r in qp.requests] == [False, True] * 4
    assert [r.wr_id for r in qp.requests] == list(range(1, 9))
    assert [r.remote_addr for r in qp.requests] == [5000 + 100 * i for i in range(8)]
    assert (ch.posted, ch.in_flight, ch.waiting, ch.max_in_flight) == (8, 8, 3, 8)
    ch.on_completion(wc(2))
    assert [(r.wr_id, r.signaled, r.remote_addr) for r in qp.posts[-1]] == [(9, False, 5800), (10, True, 5900)]
    assert (ch.posted, ch.in_flight, ch.waiting, ch.max_in_flight) == (10, 8, 1, 8)
    ch.on_completion(wc(4))
    assert [(r.wr_id, r.signaled) for r in qp.posts[-1]] == [(11, True)]
    assert (ch.posted, ch.in_flight, ch.waiting) == (11, 7, 0)
    assert not t.done()
    ch.on_completion(wc(11))
    assert t.Succeeded() and ch.idle and ch.posted == 11


async def test_max_in_flight_is_the_highest_seen() -> None:
    ch, _ = make(depth=8)
    a, b = transfer(1), transfer(2)
    ch.submit(many(a, 3))
    ch.submit(many(b, 2))
    assert ch.max_in_flight == 5
    ch.on_completion(wc(3))
    ch.submit(single(transfer(3)))
    assert (ch.in_flight, ch.max_in_flight) == (3, 5)


async def test_a_failed_completion_names_its_request_and_flushes_the_waiting_ones_in_order() -> None:
    idle: list[QpChannel] = []
    ch, qp = make(depth=2, on_failed_idle=idle.append)
    ts = [transfer(i) for i in range(4)]
    for t in ts:
        ch.submit(single(t))
    ch.on_completion(wc(2, WcStatus.REM_ACCESS_ERR, vendor_err=5))  # covers 1 (succeeded) and 2
    assert ts[0].Succeeded()
    e1 = ts[1].error()
    assert e1 is not None and (e1.wc_status, e1.vendor_err, e1.qp_num) == (WcStatus.REM_ACCESS_ERR, 5, 77)
    assert ch.state == ChannelState.FAILED
    for t in ts[2:]:  # nothing in flight any more: the waiting ones flush at once
        e = t.error()
        assert e is not None and (e.wc_status, e.vendor_err, e.qp_num) == (WcStatus.WR_FLUSH_ERR, 0, 77)
    assert [r.wr_id for r in qp.requests] == [1, 2]
    assert ch.idle and idle == []
    late = transfer(9)
    ch.submit(single(late))  # failed and idle: handed to on_failed_idle, not posted
    assert idle == [ch] and len(qp.requests) == 2 and ch.waiting == 1 and not late.done()


async def test_the_vendor_error_goes_only_to_the_named_request() -> None:
    ch, _ = make(depth=8)
    a, b = transfer(1), transfer(2)
    ch.submit(many(a, 2))
    ch.submit(single(b))  # requests 1, 2 (a) and 3 (b)
    ch.on_completion(wc(3, WcStatus.REM_OP_ERR, vendor_err=9))
    assert a.Succeeded()
    e = b.error()
    assert e is not None and (e.vendor_err, e.qp_num) == (9, 77)
    c, d = transfer(3), transfer(4)
    ch2, _ = make(depth=8)
    ch2.submit(single(c))
    ch2.submit(single(d))
    ch2.begin_abort()
    ch2.on_completion(wc(1, WcStatus.REM_OP_ERR, vendor_err=4))
    ch2.on_completion(wc(2, WcStatus.WR_FLUSH_ERR, vendor_err=6))
    ec, ed = c.error(), d.error()
    assert ec is not None and (ec.wc_status, ec.vendor_err, ec.qp_num) == (WcStatus.REM_OP_ERR, 4, 77)
    assert ed is not None and (ed.wc_status, ed.vendor_err, ed.qp_num) == (WcStatus.WR_FLUSH_ERR, 6, 77)


async def test_earlier_requests_of_a_failed_pair_flush_with_no_vendor_error() -> None:
    ch, _ = make(depth=8)
    a, b = transfer(1), transfer(2)
    ch.submit(single(a))
    ch.submit(single(b))
    ch.begin_abort()
    ch.on_completion(wc(2, WcStatus.WR_FLUSH_ERR, vendor_err=3))  # covers 1 too, flushed
    ea, eb = a.error(), b.error()
    assert ea is not None and (ea.wc_status, ea.vendor_err, ea.qp_num) == (WcStatus.WR_FLUSH_ERR, 0, 77)
    assert eb is not None and (eb.wc_status, eb.vendor_err, eb.qp_num) == (WcStatus.WR_FLUSH_ERR, 3, 77)


async def test_waiting_requests_flush_only_once_the_failed_pair_drained() -> None:
    ch, qp = make(depth=2)
    ts = [transfer(i) for i in range(3)]
    for t in ts:
        ch.submit(single(t))
    ch.on_completion(wc(1, WcStatus.RETRY_EXC_ERR))
    assert ts[0].Failed() and not ts[1].done() and not ts[2].done()
    assert ch.state == ChannelState.FAILED and ch.in_flight == 1 and ch.waiting == 1
    ch.submit(single(transfer(8)))  # failed, still draining: queued, not posted
    assert len(qp.requests) == 2 and ch.waiting == 2
    ch.on_completion(wc(2, WcStatus.WR_FLUSH_ERR))
    assert ts[1].error() is not None and ts[2].error() is not None
    assert ts[2].error().wc_status is WcStatus.WR_FLUSH_ERR  # type: ignore[union-attr]
    assert ch.idle


async def test_a_closed_channel_stays_closed_when_a_failure_comes_back() -> None:
    ch, _ = make()
    t = transfer()
    ch.submit(single(t))
    ch.state = ChannelState.CLOSED
    ch.on_completion(wc(1, WcStatus.REM_ACCESS_ERR))
    assert ch.state == ChannelState.CLOSED and t.Failed()


async def test_a_replacement_pair_posts_what_waited() -> None:
    idle: list[QpChannel] = []
    ch, _ = make(depth=1, on_failed_idle=idle.append)
    a, b = transfer(1), transfer(2)
    ch.submit(single(a))
    ch.submit(single(b))
    ch.on_completion(wc(1, WcStatus.RETRY_EXC_ERR))  # nothing in flight: b flushes at once
    assert b.Failed()
    idle.clear()  # whatever the failure itself reported: what counts is the next submit
    c = transfer(3)
    ch.submit(single(c))
    assert idle == [ch] and ch.waiting == 1
    new = FakeQP(qp_num=88, depth=1)
    ch.replace_qp(new)  # type: ignore[arg-type]
    assert (ch.qp, ch.qp_num, ch.state, ch.waiting, ch.in_flight) == (new, 88, ChannelState.READY, 0, 1)
    assert [r.wr_id for r in new.requests] == [2]  # numbering goes on across pairs
    ch.on_completion(wc(2, WcStatus.REM_ACCESS_ERR, qp_num=88))
    e = c.error()
    assert e is not None and e.qp_num == 88


async def test_fail_waiting_ends_only_the_unposted_requests() -> None:
    ch, _ = make(depth=1)
    a, b, c = transfer(1), transfer(2), transfer(3)
    for t in (a, b, c):
        ch.submit(single(t))
    assert ch.fail_waiting() == [b, c]
    eb = b.error()
    assert eb is not None and (eb.wc_status, eb.vendor_err, eb.qp_num) == (WcStatus.WR_FLUSH_ERR, 0, 77)
    assert not a.done() and ch.waiting == 0
    d = transfer(4)
    ch.submit(single(d))
    assert ch.fail_waiting(WcStatus.REM_ABORT_ERR) == [d]
    assert d.error().wc_status is WcStatus.REM_ABORT_ERR  # type: ignore[union-attr]
    assert ch.fail_waiting() == []


async def test_abandon_waiting_fails_them_with_the_message() -> None:
    ch, _ = make(depth=1)
    a, b = transfer(1), transfer(2)
    ch.submit(single(a))
    ch.submit(single(b))
    ch.abandon_waiting(StatusCode.ERR_BAD_STATE, "peer restarted", "reconnect")
    e = b.error()
    assert e is not None and (e.code, e.message, e.hint, e.wc_status) == (
        StatusCode.ERR_BAD_STATE,
        "peer restarted",
        "reconnect",
        None,
    )
    assert not a.done() and ch.waiting == 0


async def test_force_fail_in_flight_flushes_the_posted_ones() -> None:
    ch, _ = make(depth=1)
    a, b = transfer(1), transfer(2)
    ch.submit(single(a))
    ch.submit(single(b))
    ch.force_fail_in_flight()
    e = a.error()
    assert e is not None and (e.wc_status, e.vendor_err, e.qp_num) == (WcStatus.WR_FLUSH_ERR, 0, 77)
    assert ch.state == ChannelState.FAILED and ch.in_flight == 0 and not b.done() and ch.waiting == 1


async def test_begin_abort_with_nothing_in_flight_flushes_the_waiting() -> None:
    ch, qp = make(depth=1)
    ch.begin_abort()
    assert (qp.errors, ch.state, ch.sendq.failed) == (1, ChannelState.FAILED, True)
    ch2, qp2 = make(depth=1)
    a, b = transfer(1), transfer(2)
    ch2.submit(single(a))
    ch2.submit(single(b))
    ch2.begin_abort()  # one in flight: the waiting one stays until the flush comes back
    assert qp2.errors == 1 and not b.done() and ch2.waiting == 1
    ch3, _ = make(depth=1)
    c = transfer(3)
    ch3.submit(single(c))
    ch3.on_completion(wc(1))
    ch3.sendq.enqueue(single(d := transfer(4)), 1)  # waiting, nothing in flight
    d.start(1)
    ch3.begin_abort()
    assert d.error() is not None and d.error().wc_status is WcStatus.WR_FLUSH_ERR  # type: ignore[union-attr]


async def test_wait_idle_returns_once_everything_completed() -> None:
    ch, _ = make(depth=1)
    await asyncio.wait_for(ch.wait_idle(), 5)  # idle already
    a, b = transfer(1), transfer(2)
    ch.submit(single(a))
    ch.submit(single(b))
    waiter = asyncio.ensure_future(ch.wait_idle())
    other = asyncio.ensure_future(ch.wait_idle())
    await asyncio.sleep(0)
    ch.on_completion(wc(1))
    await asyncio.sleep(0)
    assert not waiter.done()  # b was posted: not idle yet
    other.cancel()
    await asyncio.sleep(0)
    ch.on_completion(wc(2))
    await asyncio.wait_for(waiter, 5)
    assert ch.idle and other.cancelled()
    c = transfer(3)
    ch.submit(single(c))
    ch.submit(single(transfer(4)))
    w2 = asyncio.ensure_future(ch.wait_idle())
    await asyncio.sleep(0)
    ch.force_fail_in_flight()
    await asyncio.sleep(0)
    assert not w2.done()
    ch.fail_waiting()
    await asyncio.wait_for(w2, 5)
    ch.submit(single(transfer(5)))
    w3 = asyncio.ensure_future(ch.wait_idle())
    await asyncio.sleep(0)
    ch.abandon_waiting(StatusCode.ERR_BAD_STATE, "x", "y")
    await asyncio.wait_for(w3, 5)


async def test_a_jobs_columns_have_the_types_work_batch_declares() -> None:
    t = transfer()
    plan = Plan(
        np.array([0, 100], dtype=np.int64),
        np.array([10, 20], dtype=np.int64),
        np.array([0, 1, 2], dtype=np.int64),
        np.array([0, 50], dtype=np.int64),
        np.array([10, 20], dtype=np.int64),
    )
    for job in (
        Job(t, plan, Opcode.RDMA_READ, local_addr=1000, lkey=7, remote_addr=5000, rkey=9),
        single(t, Opcode.RDMA_READ),
        single(t, Opcode.RDMA_WRITE),
    ):
        b = job.chunk(0, len(job), 1, np.ones(len(job), dtype=np.bool_))
        dtypes = [a.dtype for a in (b.opcode, b.remote_addr, b.rkey, b.length, b.sge_addr, b.sge_length, b.sge_lkey)]
        assert dtypes == [np.uint8, np.uint64, np.uint32, np.uint64, np.uint64, np.uint64, np.uint32]
        assert b.sge_start.dtype == np.int64


# -- the columns of a job's batches: one entry per request, or per scatter entry, in the backends' dtypes ---


REQUEST_COLUMNS = {"opcode": np.uint8, "remote_addr": np.uint64, "rkey": np.uint32, "length": np.uint64}
ENTRY_COLUMNS = {"sge_addr": np.uint64, "sge_length": np.uint64, "sge_lkey": np.uint32}


def check_columns(batch: WorkBatch, n: int, entries: int) -> None:
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
    check_columns(batch, 1, 1)
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
    check_columns(job.chunk(1, 3, 8, np.array([False, True])), 2, 3)
    check_columns(job.chunk(0, 1, 7, np.array([False])), 1, 1)
    check_columns(job.chunk(0, 3, 1, np.array([False, False, True])), 3, 4)


# -- what a session's single jobs share: one pair of read-only key arrays, made once ---------------------


def keyed_batch(rkey: int, lkey: int, opcode: Opcode = Opcode.RDMA_WRITE) -> WorkBatch:
    job = Job.single(transfer(), opcode, local_addr=64, lkey=lkey, remote_addr=128, rkey=rkey, size=8)
    return job.chunk(0, 1, 1, np.array([True]))


@pytest.mark.parametrize("opcode", [Opcode.RDMA_READ, Opcode.RDMA_WRITE])
async def test_single_jobs_of_one_session_share_their_key_arrays(opcode: Opcode) -> None:
    first, second = keyed_batch(40001, 40002, opcode), keyed_batch(40001, 40002, opcode)
    assert np.shares_memory(first.rkey, second.rkey) and np.shares_memory(first.sge_lkey, second.sge_lkey)
    assert (int(second.rkey[0]), int(second.sge_lkey[0])) == (40001, 40002)
    other = keyed_batch(40003, 40002, opcode)  # another session's keys: arrays of their own
    assert not np.shares_memory(first.rkey, other.rkey)
    assert (int(other.rkey[0]), int(other.sge_lkey[0])) == (40003, 40002)


@pytest.mark.parametrize("cached", [False, True])
async def test_a_single_jobs_shared_columns_are_read_only(cached: bool) -> None:
    # Keys no other process used: a process forked from one that ran this test before (mutmut's
    # workers are) must still make its own key arrays, not find the parent's in the cache.
    rkey, lkey = 2 * os.getpid() + cached, 2**31 + os.getpid()
    if cached:
        keyed_batch(rkey, lkey)
    b = keyed_batch(rkey, lkey)
    for column in (b.rkey, b.sge_lkey, b.opcode, b.sge_start):
        with pytest.raises(ValueError, match="read-only"):
            column[0] = 3
    assert (int(b.rkey[0]), int(b.sge_lkey[0]), int(b.opcode[0])) == (rkey, lkey, int(Opcode.RDMA_WRITE))
    again = keyed_batch(rkey, lkey)
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


async def test_singles_behind_a_request_in_flight_go_out_as_one_batch_at_the_end_of_the_loop_pass() -> None:
    """Nagle's rule for posts, on a pair that gathers singles: with the pair busy, the singles posted in
    one pass of the loop wait for its end and go out as one post, in order, each its own signaled request
    that settles only its own transfer."""
    ch, qp = make(depth=16, gathers=True)
    first = transfer(0)
    ch.submit(single(first))
    assert len(qp.posts) == 1  # nothing in flight: at once, before submit returned
    ts = [transfer(i) for i in range(1, 6)]
    ops = [Opcode.RDMA_READ, Opcode.RDMA_WRITE, Opcode.RDMA_WRITE, Opcode.RDMA_READ, Opcode.RDMA_WRITE]
    for i, (t, op) in enumerate(zip(ts, ops, strict=True)):
        ch.submit(Job.single(t, op, local_addr=1000 + i, lkey=7 + i, remote_addr=5000 + i, rkey=9 + i, size=8 + i))
    assert (len(qp.posts), ch.posted, ch.waiting) == (1, 1, 5)
    await asyncio.sleep(0)
    assert (len(qp.posts), ch.posted, ch.waiting, ch.in_flight, ch.max_in_flight) == (2, 6, 0, 6, 6)
    got = [(r.wr_id, r.opcode, r.sges, r.remote_addr, r.rkey, r.signaled) for r in qp.posts[1]]
    assert got == [(2 + i, op, (Sge(1000 + i, 8 + i, 7 + i),), 5000 + i, 9 + i, True) for i, op in enumerate(ops)]
    ch.on_completion(wc(1))
    ch.on_completion(wc(3, WcStatus.REM_ACCESS_ERR, vendor_err=5))
    assert first.Succeeded() and ts[0].Succeeded() and ts[1].Failed() and not ts[2].done()
    error = ts[1].error()
    assert error is not None and (error.wc_status, error.vendor_err) == (WcStatus.REM_ACCESS_ERR, 5)


async def test_a_single_gathered_alone_and_a_batch_behind_waiting_singles_keep_submission_order() -> None:
    """A multi-request job submitted in the same pass as waiting singles posts at once, behind them; a
    single left alone at the end of the pass goes out on its own."""
    ch, qp = make(depth=16, gathers=True)
    ch.submit(single(transfer(0)))
    ch.submit(single(transfer(1), Opcode.RDMA_READ))
    ch.submit(single(transfer(2)))
    ch.submit(many(transfer(3), 3))
    assert [[r.wr_id for r in p] for p in qp.posts] == [[1], [2, 3], [4, 5, 6]]
    assert [r.opcode for r in qp.posts[1]] == [Opcode.RDMA_READ, Opcode.RDMA_WRITE]
    await asyncio.sleep(0)
    assert len(qp.posts) == 3 and ch.waiting == 0  # the end-of-pass post found nothing left
    ch.submit(single(transfer(4)))
    await asyncio.sleep(0)
    assert [[r.wr_id for r in p] for p in qp.posts[3:]] == [[7]]


async def test_a_pair_that_does_not_gather_posts_each_single_as_it_comes() -> None:
    ch, qp = make(depth=16)
    for i in range(3):
        ch.submit(single(transfer(i)))
    assert [[r.wr_id for r in p] for p in qp.posts] == [[1], [2], [3]]


def test_without_a_running_loop_a_gathering_pair_posts_a_single_at_once() -> None:
    loop = asyncio.new_event_loop()
    try:
        ch, qp = make(depth=4, gathers=True)
        for i in (1, 2):
            ch.submit(single(Transfer(loop, i, Opcode.RDMA_WRITE, "b", (0,), (0,), (8,))))
        assert [[r.wr_id for r in p] for p in qp.posts] == [[1], [2]]
    finally:
        loop.close()
