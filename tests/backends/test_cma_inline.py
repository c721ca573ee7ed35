"""The cma pair's two ways to execute a batch: on the posting thread (a small batch to an idle pair)
and on its worker. Both must move the same bytes, complete alike and in posting order, check before
a byte moves, and fail the same way; only where the copy runs differs."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from moriio_async.backends.base import QpState
from moriio_async.backends.cma import CmaOptions, CmaQueuePair, VendorErr, initiator, worker
from moriio_async.backends.cma.worker import Executor, Outcome
from moriio_async.status import Access, Opcode, WcStatus
from moriio_async.work import WorkBatch, WorkCompletion, WorkRequest

from .harness import WAIT, Pair, PairFactory, random_bytes, statuses, wr_ids
from .test_cma_specific import shared_region, to

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.only_backends("cma", reason="tests where the cma backend executes a batch"),
]

INLINE = CmaOptions()
WORKER = CmaOptions(inline_bytes=0)
MODES = pytest.mark.parametrize("tuning", [INLINE, WORKER], ids=["inline", "worker"])


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The thread that executed each chunk (``Executor.run``), in order."""
    seen: list[int] = []
    real = Executor.run

    def recorded(self: Executor, batch: WorkBatch, lo: int, hi: int, may_wait: bool = True) -> Outcome:
        seen.append(threading.get_ident())
        return real(self, batch, lo, hi, may_wait)

    monkeypatch.setattr(Executor, "run", recorded)
    return seen


def scattered(pair: Pair, opcode: Opcode, first: int) -> list[WorkRequest]:
    """Forty requests of one to three SGEs of odd lengths at odd places, every third unsignaled."""
    wrs = []
    for i in range(40):
        local = [(i * 20011 + k * 4099, 777 + 131 * k + i) for k in range(1 + i % 3)]
        wr = pair.wr(first + i, opcode, local, i * 17389 + 5, signaled=i % 3 != 1 or i == 39)
        wrs.append(wr)
    return wrs


def outcome(wcs: list[WorkCompletion]) -> list[tuple[int, WcStatus, Opcode, int]]:
    return [(wc.wr_id, wc.status, wc.opcode, wc.byte_len) for wc in wcs]


@pytest.mark.parametrize("opcode", [Opcode.RDMA_WRITE, Opcode.RDMA_READ])
def test_inline_and_worker_move_the_same_bytes_and_complete_alike(
    pairs: PairFactory, backend_name: str, opcode: Opcode
) -> None:
    results = []
    for tuning in (INLINE, WORKER):
        pair = pairs(1 << 20, 1 << 20, specific=tuning)
        pair.a.buf[:] = random_bytes(1 << 20, 11)
        wcs = pair.run(scattered(pair, opcode, 100))
        results.append((outcome(wcs), pair.a.buf.copy(), pair.b.buf.copy()))
    (inline_wcs, inline_a, inline_b), (worker_wcs, worker_a, worker_b) = results
    assert inline_wcs == worker_wcs
    assert [wc[0] for wc in inline_wcs] == [100 + i for i in range(40) if i % 3 != 1 or i == 39]
    assert all(wc[1] == WcStatus.SUCCESS for wc in inline_wcs)
    assert np.array_equal(inline_a, worker_a) and np.array_equal(inline_b, worker_b)
    # The bytes landed where the requests said: each request's remote range is its SGEs, gathered.
    for i in range(40):
        gathered = np.concatenate([inline_a[i * 20011 + k * 4099 :][: 777 + 131 * k + i] for k in range(1 + i % 3)])
        assert np.array_equal(gathered, inline_b[i * 17389 + 5 :][: len(gathered)]), f"request {i}"


def test_a_small_batch_to_an_idle_pair_is_done_when_post_returns(
    pairs: PairFactory, backend_name: str, runs: list[int]
) -> None:
    pair = pairs(1 << 20, 1 << 20)
    pair.a.buf[:] = 0x3C
    pair.a.qp.post_send([pair.write(1, 0, 4096, 0), pair.write(2, 8192, 4096, 8192)])
    # No wait: the posting thread moved the bytes and made the completion before post returned.
    assert wr_ids(pair.a.cq.poll(8)) == [1, 2]
    assert runs == [threading.get_ident()]
    assert bool((pair.b.buf[:4096] == 0x3C).all()) and bool((pair.b.buf[8192:12288] == 0x3C).all())


def test_with_inline_bytes_0_the_worker_executes(pairs: PairFactory, backend_name: str, runs: list[int]) -> None:
    pair = pairs(1 << 20, 1 << 20, specific=WORKER)
    assert statuses(pair.run([pair.write(1, 0, 4096, 0)])) == [WcStatus.SUCCESS]
    assert len(runs) == 1 and runs[0] != threading.get_ident()


def test_a_batch_over_the_limit_or_behind_an_unpolled_one_goes_to_the_worker_in_order(
    pairs: PairFactory, backend_name: str, runs: list[int]
) -> None:
    pair = pairs(4 << 20, 4 << 20, specific=CmaOptions(inline_bytes=64 << 10))
    pair.a.buf[:] = random_bytes(4 << 20, 5)
    qp, me = pair.a.qp, threading.get_ident()
    qp.post_send([pair.write(1, 0, 4096, 0)])  # idle: inline
    qp.post_send([pair.write(2, 4096, 4096, 4096)])  # the first completion is not polled yet: the worker
    wcs = pair.waiter.wait(2)
    qp.post_send([pair.write(3, 1 << 20, 2 << 20, 1 << 20)])  # idle again, but over inline_bytes: the worker
    wcs += pair.waiter.wait(1)
    assert wr_ids(wcs) == [1, 2, 3] and statuses(wcs) == [WcStatus.SUCCESS] * 3
    assert runs[0] == me and all(t != me for t in runs[1:])
    assert np.array_equal(pair.b.buf[:8192], pair.a.buf[:8192])
    assert np.array_equal(pair.b.buf[1 << 20 : 3 << 20], pair.a.buf[1 << 20 : 3 << 20])


def test_inline_bytes_is_the_largest_batch_the_posting_thread_copies(
    pairs: PairFactory, backend_name: str, runs: list[int]
) -> None:
    limit = 64 << 10
    pair = pairs(1 << 20, 1 << 20, specific=CmaOptions(inline_bytes=limit))
    pair.a.buf[:] = random_bytes(1 << 20, 9)
    me = threading.get_ident()
    # Exactly inline_bytes, in two requests: the posting thread, done when post returns.
    pair.a.qp.post_send([pair.write(1, 0, limit // 2, 0), pair.write(2, limit // 2, limit // 2, limit // 2)])
    assert wr_ids(pair.a.cq.poll(8)) == [1, 2] and runs == [me]
    # One byte more, to the idle pair: the worker.
    wcs = pair.run([pair.write(3, limit, limit + 1, limit)])
    assert statuses(wcs) == [WcStatus.SUCCESS]
    assert len(runs) == 2 and runs[1] != me
    assert np.array_equal(pair.b.buf[: 2 * limit + 1], pair.a.buf[: 2 * limit + 1])


@MODES
@pytest.mark.parametrize("opcode", [Opcode.RDMA_WRITE, Opcode.RDMA_READ])
def test_a_revoked_region_fails_on_either_path_and_nothing_moves(
    pairs: PairFactory, backend_name: str, tuning: CmaOptions, opcode: Opcode
) -> None:
    pair = pairs(1 << 20, 1 << 20, specific=tuning)
    stale = pair.b.register(pair.b.buf, Access.all())
    pair.a.buf[:] = 0xAB
    before_a, before_b = pair.a.buf.copy(), pair.b.buf.copy()
    pair.b.deregister(stale)
    wcs = pair.run([pair.write(0, 0, 4096, 0), to(stale, pair, 1, opcode, [(0, 4096)], 0), pair.write(2, 0, 4096, 0)],
                   expect=2)  # fmt: skip
    # The first request (a live region) succeeds; the revoked one fails, the rest flush.
    assert outcome(wcs)[0][:2] == (0, WcStatus.SUCCESS)
    assert statuses(wcs[1:]) == [WcStatus.REM_ACCESS_ERR]
    assert wcs[1].vendor_err in (VendorErr.REMOTE_REVOKED, VendorErr.UNKNOWN_RKEY)
    flushed = pair.waiter.wait(1)
    assert statuses(flushed) == [WcStatus.WR_FLUSH_ERR]
    assert np.array_equal(pair.a.buf, before_a), "a byte moved into local memory for the revoked request"
    assert np.array_equal(pair.b.buf[4096:], before_b[4096:])
    assert pair.a.qp.state == QpState.ERR


def test_a_shared_allocation_still_to_map_is_left_to_the_worker(
    pairs: PairFactory, backend_name: str, runs: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    mapped_on: list[int] = []
    real_map = initiator.TargetLink.map

    def recorded(self: initiator.TargetLink, alloc_id: int, st: object, timeout: float) -> bool:
        mapped_on.append(threading.get_ident())
        return real_map(self, alloc_id, st, timeout)  # type: ignore[arg-type]

    monkeypatch.setattr(initiator.TargetLink, "map", recorded)
    pair = pairs(1 << 20, 1 << 20)
    mr, shared = shared_region(pair, 1 << 20)
    pair.a.buf[:] = random_bytes(1 << 20, 9)
    me = threading.get_ident()
    assert statuses(pair.run([to(mr, pair, 0, Opcode.RDMA_WRITE, [(0, 65536)], 4096)])) == [WcStatus.SUCCESS]
    # The posting thread found the allocation unmapped and left the request to the worker, which mapped it.
    assert mapped_on and all(t != me for t in mapped_on)
    assert runs[0] == me and runs[-1] != me
    assert np.array_equal(shared[4096 : 4096 + 65536], pair.a.buf[:65536])
    # Mapped now: the next one runs inline, through the mapping.
    runs.clear()
    assert statuses(pair.run([to(mr, pair, 1, Opcode.RDMA_READ, [(1 << 19, 65536)], 4096)])) == [WcStatus.SUCCESS]
    assert runs == [me]
    assert np.array_equal(pair.a.buf[1 << 19 :][:65536], shared[4096 : 4096 + 65536])
    qp = pair.a.qp
    assert isinstance(qp, CmaQueuePair) and qp.link is not None and len(qp.link.maps) == 1


def test_an_error_while_executing_inline_fails_the_pair_and_post_still_returns(
    pairs: PairFactory, backend_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pair = pairs(1 << 20, 1 << 20)

    def broken(self: Executor, batch: WorkBatch, lo: int, hi: int, may_wait: bool = True) -> Outcome:
        raise RuntimeError("a bug in the executor")

    monkeypatch.setattr(worker.Executor, "run", broken)
    pair.a.qp.post_send([pair.write(1, 0, 4096, 0), pair.write(2, 4096, 4096, 4096)])
    wcs = pair.waiter.wait(2)
    assert wr_ids(wcs) == [1, 2]
    assert statuses(wcs) == [WcStatus.GENERAL_ERR, WcStatus.WR_FLUSH_ERR]
    assert pair.a.qp.state == QpState.ERR
    # The pair stays usable as a verbs pair in ERR: later posts flush at once.
    pair.a.qp.post_send([pair.write(3, 0, 4096, 0)])
    assert statuses(pair.waiter.wait(1)) == [WcStatus.WR_FLUSH_ERR]


def test_a_batch_another_thread_posts_while_the_poster_executes_waits_until_the_poster_is_done(
    pairs: PairFactory, backend_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One thread at a time executes the pair's requests: the second batch is queued, and the worker
    # must not take the head (the first batch, still being copied inline) meanwhile.
    pair = pairs(1 << 20, 1 << 20)
    pair.a.buf[:] = random_bytes(1 << 20, 13)
    poster: list[int] = []
    copying, done = threading.Event(), threading.Event()
    others: list[tuple[int, int, bool]] = []  # (first wr_id, lo, poster done) of each chunk another thread ran
    real = Executor.run

    def gated(self: Executor, batch: WorkBatch, lo: int, hi: int, may_wait: bool = True) -> Outcome:
        if threading.get_ident() in poster:
            copying.set()
            done.wait(WAIT)
        else:
            others.append((int(batch.wr_id), lo, done.is_set()))
        return real(self, batch, lo, hi, may_wait)

    monkeypatch.setattr(Executor, "run", gated)

    def post_first() -> None:
        poster.append(threading.get_ident())
        pair.a.qp.post_send([pair.write(1, 0, 4096, 0)])

    thread = threading.Thread(target=post_first)
    thread.start()
    try:
        assert copying.wait(WAIT)
        pair.a.qp.post_send([pair.write(2, 4096, 4096, 4096)])  # the pair is busy: the worker's
        time.sleep(0.3)  # room for a worker that would wrongly take the head now (no assertion on time)
    finally:
        done.set()
        thread.join()
    wcs = pair.waiter.wait(2)
    assert wr_ids(wcs) == [1, 2] and statuses(wcs) == [WcStatus.SUCCESS] * 2
    assert all(after for _first, _lo, after in others), others  # (the poster may run the second batch itself)
    assert np.array_equal(pair.b.buf[:8192], pair.a.buf[:8192])
