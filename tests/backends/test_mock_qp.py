"""The mock queue pair's own seams and rules: ``hold``/``step`` (completion timing as a function of
the test's calls), ``fail_next`` and ``vanish``, what connect and post refuse and with which message,
and the send-queue slots each completion frees (the unsignaled successes it covers); that its quick path
(a single request of one SGE) and the general one end alike, and its lifecycle (``closed``, ``to_error``,
a closed passive pair leaving its fabric)."""

from __future__ import annotations

import numpy as np
import pytest

from moriio_async.backends import open_backend
from moriio_async.backends.base import MemoryRegion, QpState, SendQueueFull
from moriio_async.backends.mock import MockOptions
from moriio_async.backends.mock.fabric import MockFabric
from moriio_async.errors import InvalidArgument, PeerError
from moriio_async.status import Access, Opcode, WcStatus
from moriio_async.work import Sge, WorkBatch, WorkRequest

from .harness import Pair, PairFactory, make_options, statuses, wr_ids

pytestmark = [pytest.mark.timeout(60), pytest.mark.only_backends("mock", reason="the mock queue pair's seams")]

W, R = Opcode.RDMA_WRITE, Opcode.RDMA_READ
HOLD = MockOptions(hold=True)
SIZE = 256


def polled(pair: Pair) -> list[tuple[int, WcStatus, Opcode, int]]:
    return [(wc.wr_id, wc.status, wc.opcode, wc.byte_len) for wc in pair.a.cq.poll(64)]


def requests(pair: Pair, ops: list[Opcode], signaled: list[bool] | None = None, first: int = 0) -> list[WorkRequest]:
    signaled = signaled or [True] * len(ops)
    return [pair.wr(i, op, [(i * SIZE, SIZE)], i * SIZE, signaled=s)
            for i, (op, s) in enumerate(zip(ops, signaled, strict=True), first)]  # fmt: skip


def moved(pair: Pair, i: int, op: Opcode) -> bool:
    """Whether request ``i`` of ``requests`` has moved its bytes (A starts zeroed, B random)."""
    a, b = pair.a.buf[i * SIZE : (i + 1) * SIZE], pair.b.buf[i * SIZE : (i + 1) * SIZE]
    return bool(np.array_equal(a, b)) if op is R else bool(np.array_equal(b, np.zeros(SIZE, np.uint8)))


def test_held_requests_run_only_when_stepped_oldest_first(pairs: PairFactory) -> None:
    pair = pairs(specific=HOLD)
    qp = pair.a.qp
    qp.post_send(requests(pair, [W, W, R], [True, False, True]))
    qp.post_send(requests(pair, [R, W], first=3))
    assert qp.held == 5 and polled(pair) == []
    assert not any(moved(pair, i, op) for i, op in enumerate([W, W, R, R, W]))
    assert qp.step() == 1 and qp.held == 4
    assert polled(pair) == [(0, WcStatus.SUCCESS, W, SIZE)] and moved(pair, 0, W) and not moved(pair, 1, W)
    assert qp.step(3) == 3 and qp.held == 1  # crosses into the second batch: it is cut
    assert polled(pair) == [(2, WcStatus.SUCCESS, R, SIZE), (3, WcStatus.SUCCESS, R, SIZE)]
    assert moved(pair, 3, R) and not moved(pair, 4, W)
    assert qp.step(10) == 1 and qp.held == 0 and polled(pair) == [(4, WcStatus.SUCCESS, W, SIZE)]
    assert qp.step(10) == 0 and qp.state == QpState.RTS


def test_fail_next_ends_the_next_executed_request_and_flushes_the_rest(pairs: PairFactory) -> None:
    pair = pairs(specific=HOLD)
    qp = pair.a.qp
    qp.post_send(requests(pair, [W, W, W], [False, True, True]))
    qp.step(1)  # an unsignaled success: no completion yet
    qp.fail_next(WcStatus.REM_ACCESS_ERR)
    assert polled(pair) == [] and qp.state == QpState.RTS
    assert qp.step(1) == 1
    assert polled(pair) == [(1, WcStatus.REM_ACCESS_ERR, W, 0)] and qp.state == QpState.ERR
    assert not moved(pair, 1, W)
    qp.step(1)
    assert polled(pair) == [(2, WcStatus.WR_FLUSH_ERR, W, 0)]


def test_fail_next_without_hold_applies_to_the_next_post_once(pairs: PairFactory) -> None:
    for single in (True, False):
        pair = pairs()
        qp = pair.a.qp
        qp.fail_next(WcStatus.LOC_PROT_ERR)
        wrs = requests(pair, [R] if single else [R, R])
        qp.post_send(wrs)
        got = pair.waiter.wait(len(wrs))
        assert statuses(got) == [WcStatus.LOC_PROT_ERR, WcStatus.WR_FLUSH_ERR][: len(wrs)]
        assert not moved(pair, 0, R) and qp.state == QpState.ERR


def test_vanish_fails_the_oldest_held_request_as_a_dead_peer(pairs: PairFactory) -> None:
    pair = pairs(specific=HOLD)
    qp = pair.a.qp
    qp.post_send(requests(pair, [W, R, W], [False, False, True]))
    qp.vanish()
    assert qp.held == 0 and qp.state == QpState.ERR
    assert [(w, s) for w, s, _, _ in polled(pair)] == [
        (0, WcStatus.RETRY_EXC_ERR),
        (1, WcStatus.WR_FLUSH_ERR),
        (2, WcStatus.WR_FLUSH_ERR),
    ]
    assert not moved(pair, 0, W) and not moved(pair, 1, R)
    qp.post_send(requests(pair, [W]))  # in ERR: flushed at once, even with hold
    assert polled(pair) == [(0, WcStatus.WR_FLUSH_ERR, W, 0)]
    idle = pairs(specific=HOLD)
    idle.a.qp.vanish()  # nothing held: no completion, the pair is in ERR all the same
    assert idle.a.qp.state == QpState.ERR and polled(idle) == []
    idle.a.qp.post_send(requests(idle, [R]))
    assert polled(idle) == [(0, WcStatus.WR_FLUSH_ERR, R, 0)]


def test_a_request_to_a_closed_peer_runs_out_of_retries(pairs: PairFactory) -> None:
    for ops in ([W], [W, W], [R, W]):
        pair = pairs()
        pair.b.qp.close()
        pair.a.qp.post_send(requests(pair, ops))
        got = pair.waiter.wait(len(ops))
        assert statuses(got) == [WcStatus.RETRY_EXC_ERR] + [WcStatus.WR_FLUSH_ERR] * (len(ops) - 1)
        assert not moved(pair, 0, ops[0])


def test_each_completion_frees_the_slots_of_the_successes_it_covers(pairs: PairFactory) -> None:
    for hold in (False, True):
        pair = pairs(sq_depth=4, specific=MockOptions(hold=hold))
        qp = pair.a.qp
        qp.post_send(requests(pair, [W]))
        qp.post_send(requests(pair, [W, R], [False, False], first=1))
        with pytest.raises(SendQueueFull, match="2 requests, 1 free slots of 4"):
            qp.post_send(requests(pair, [W, W], first=3))
        qp.post_send(requests(pair, [W], first=3))  # the fourth slot
        with pytest.raises(SendQueueFull, match="1 requests, 0 free slots of 4"):
            qp.post_send(requests(pair, [W], first=4))
        qp.step(4)
        assert [w for w, *_ in polled(pair)] == [0, 3]  # frees 1, then 3 (requests 1 to 3)
        qp.post_send(requests(pair, [W, W, R, R], [False, False, False, False]))
        qp.step(4)
        assert polled(pair) == []  # four unsignaled successes hold every slot until a completion
        with pytest.raises(SendQueueFull):
            qp.post_send(requests(pair, [W]))


def test_unsignaled_successes_are_covered_across_posts_and_by_a_failure(pairs: PairFactory) -> None:
    pair = pairs(sq_depth=3)
    qp = pair.a.qp
    qp.post_send(requests(pair, [W], [False]))  # one request: the quick path
    qp.post_send(requests(pair, [W, R], [False, False], first=1))
    assert polled(pair) == []
    bad = pair.wr(3, W, [(0, SIZE)], 0, rkey=pair.b.mr.rkey ^ 2)
    with pytest.raises(SendQueueFull):
        qp.post_send([bad])
    pair.a.qp.to_error()  # the three successes stay uncovered: nothing frees them but a completion
    with pytest.raises(SendQueueFull):
        qp.post_send([bad])
    fresh = pairs(sq_depth=3)
    fresh.a.qp.post_send(requests(fresh, [W, W], [False, False]))
    fresh.a.qp.post_send([fresh.wr(2, W, [(0, SIZE)], 0, rkey=fresh.b.mr.rkey ^ 2)])
    assert [(w, s) for w, s, _, _ in polled(fresh)] == [(2, WcStatus.REM_ACCESS_ERR)]
    fresh.a.qp.post_send(requests(fresh, [W, W, W]))  # the failure freed all three slots
    assert wr_ids(fresh.waiter.wait(3)) == [0, 1, 2]


def test_what_post_refuses(pairs: PairFactory) -> None:
    pair = pairs(max_sge=2)
    qp = pair.a.qp
    n = qp.qp_num
    with pytest.raises(InvalidArgument, match=f"^qp {pair.b.qp.qp_num} cannot post: the passive pair only answers$"):
        pair.b.qp.post_send(requests(pair, [W]))
    with pytest.raises(InvalidArgument, match=f"^3 SGEs, qp {n} takes at most 2$"):
        qp.post_send([pair.wr(0, W, [(0, 8), (8, 8), (16, 8)], 0)])
    with pytest.raises(InvalidArgument, match=f"^3 SGEs, qp {n} takes at most 2$"):
        qp.post_send([pair.wr(0, W, [(0, 8)], 0), pair.wr(1, W, [(0, 8), (8, 8), (16, 8)], 0)])
    qp.post_send([pair.wr(0, W, [(0, 8), (8, 8)], 0), pair.wr(1, R, [(0, 8)], 64)])  # two are fine
    assert statuses(pair.waiter.wait(2)) == [WcStatus.SUCCESS] * 2
    for ops in ([2], [W, 2, R], [2, 2], [1], [R, R, 3]):  # 1: a WRITE with immediate, 2: a SEND, 3: SEND_WITH_IMM
        batch = WorkBatch.from_requests(requests(pair, [W] * len(ops)))
        batch.opcode = np.array(ops, dtype=np.uint8)
        bad = next(op for op in ops if op not in (W, R))
        with pytest.raises(InvalidArgument, match=f"^unsupported opcode {bad}$"):
            qp.post(batch)
    qp.post(WorkBatch.from_requests([]))  # nothing to do
    pair.a.qp.close()
    with pytest.raises(InvalidArgument, match=f"^qp {n} cannot post: it is {QpState.ERR} and closed$"):
        qp.post_send(requests(pair, [W]))
    qp.close()  # again: nothing
    assert qp.closed and qp.state == QpState.ERR


def test_a_pair_not_connected_refuses_posts() -> None:
    backend = open_backend("mock", make_options("mock"))
    try:
        qp = backend.create_qp(backend.create_cq(8))
        assert qp.state == QpState.INIT
        with pytest.raises(InvalidArgument, match=f"^qp {qp.qp_num} cannot post: it is {QpState.INIT}$"):
            qp.post_send([WorkRequest(0, W, (Sge(0, 8, 1),), 0, 1)])
    finally:
        backend.close()


def test_what_connect_refuses() -> None:
    backend = open_backend("mock", make_options("mock"))
    try:
        a, b = (backend.create_qp(backend.create_cq(8)) for _ in range(2))
        ep = dict(a.endpoint())
        assert ep["backend"] == "mock" and ep["qp_num"] == a.qp_num and ep["accepting"] is False
        assert len(str(ep["token"])) == 16 and ep["token"] != b.endpoint()["token"]
        with pytest.raises(InvalidArgument, match="not a mock queue-pair endpoint"):
            a.connect({"backend": "tcp", "accepting": True, "token": ep["token"]})
        with pytest.raises(PeerError, match=f"qp {b.qp_num}: no mock queue pair with token 'nope' waits") as refused:
            b.connect({"backend": "mock", "accepting": True, "token": "nope"})
        assert refused.value.hint == (
            "the mock connects engines of one process (and one MockFabric); use tcp across processes"
        )
        with pytest.raises(PeerError, match="no mock queue pair with token '' waits"):
            b.connect({"backend": "mock", "accepting": True})
        assert b.state == QpState.INIT
        a.connect({"backend": "mock", "accepting": False, "token": "x"})  # passive: waits for b
        assert a.state == QpState.RTS and a.endpoint()["accepting"] is True
        with pytest.raises(InvalidArgument, match=f"connect needs a queue pair in INIT \\(qp {a.qp_num} is "):
            a.connect(b.endpoint())
        b.connect({"accepting": True, "token": ep["token"]})  # "backend" may be left out
        assert b.state == QpState.RTS
        c = backend.create_qp(backend.create_cq(8))
        with pytest.raises(PeerError, match="no mock queue pair"):  # a's token was claimed
            c.connect({"backend": "mock", "accepting": True, "token": ep["token"]})
        d = backend.create_qp(backend.create_cq(8))
        d.connect({"accepting": False})
        token = d.endpoint()["token"]
        d.close()
        with pytest.raises(PeerError, match="no mock queue pair"):  # closed before it was dialled
            c.connect({"accepting": True, "token": token})
    finally:
        backend.close()


# (local access, remote access): what a WRITE and a READ complete with. A WRITE reads local memory
# (no right needed) and needs REMOTE_WRITE; a READ writes local memory (LOCAL_WRITE) and needs REMOTE_READ.
NONE, LW, RR, LWRW = Access(0), Access.LOCAL_WRITE, Access.REMOTE_READ, Access.LOCAL_WRITE | Access.REMOTE_WRITE
ACCESS = [(la, ra) for la in (NONE, LW, RR) for ra in (NONE, RR, LWRW)]


def expected_status(op: Opcode, local: Access, remote: Access) -> WcStatus:
    if op is R and not local & Access.LOCAL_WRITE:
        return WcStatus.LOC_PROT_ERR
    if not remote & (Access.REMOTE_READ if op is R else Access.REMOTE_WRITE):
        return WcStatus.REM_ACCESS_ERR
    return WcStatus.SUCCESS


def sges(mr: MemoryRegion, i: int, *, two: bool) -> tuple[Sge, ...]:
    """Request ``i``'s block of ``mr``: one SGE, or its two halves."""
    at, half = mr.addr + i * SIZE, SIZE // 2
    return (Sge(at, half, mr.lkey), Sge(at + half, half, mr.lkey)) if two else (Sge(at, SIZE, mr.lkey),)


@pytest.mark.parametrize("shape", ["one", "held-one", "two-sges", "chunk", "chunk-two-sges"])
@pytest.mark.parametrize("op", [W, R], ids=["write", "read"])
def test_access_rights_at_both_ends_for_every_shape_of_post(pairs: PairFactory, op: Opcode, shape: str) -> None:
    """The quick path of a single request, the general one (held, or several SGEs) and a chunk of equal
    requests apply the same rights, and a refused request moves no byte."""
    for local_access, remote_access in ACCESS:
        pair = pairs(specific=MockOptions(hold=shape == "held-one"))
        src = np.random.default_rng(1).integers(0, 256, 4 * SIZE, dtype=np.uint8)
        dst = np.random.default_rng(2).integers(0, 256, 4 * SIZE, dtype=np.uint8)
        mine = pair.a.register(src if op is W else dst, local_access)
        theirs = pair.b.register(dst if op is W else src, remote_access)
        k = 4 if shape.startswith("chunk") else 1
        wrs = [WorkRequest(i, op, sges(mine, i, two=shape.endswith("two-sges")), theirs.addr + i * SIZE, theirs.rkey)
               for i in range(k)]  # fmt: skip
        before = dst.copy()
        pair.a.qp.post_send(wrs)
        pair.a.qp.step(k)
        want = expected_status(op, local_access, remote_access)
        got = statuses(pair.waiter.wait(k))
        flushed = [WcStatus.WR_FLUSH_ERR] * (k - 1)
        assert got == ([want, *flushed] if want else [want] * k), (local_access, remote_access)
        if want is WcStatus.SUCCESS:
            assert np.array_equal(dst[: k * SIZE], src[: k * SIZE])
        else:
            assert np.array_equal(dst, before), "a refused request moved bytes"


def test_the_slots_of_a_failure_and_its_flushes_come_back_exactly(pairs: PairFactory) -> None:
    pair = pairs(sq_depth=4)
    qp = pair.a.qp
    qp.post_send(requests(pair, [W], [False]))
    qp.post_send([pair.wr(1, W, [(0, SIZE)], 0, rkey=pair.b.mr.rkey ^ 2)])
    wcs = pair.a.cq.poll(8)  # the failure frees its own slot and the success before it
    assert [(wc.wr_id, wc.status, wc.byte_len, wc.qp_num) for wc in wcs] == [(1, WcStatus.REM_ACCESS_ERR, 0, qp.qp_num)]
    qp.post_send(requests(pair, [W, R]))  # in ERR: flushed at once, one slot each
    wcs = pair.a.cq.poll(8)
    assert [(wc.wr_id, wc.status, wc.byte_len, wc.qp_num) for wc in wcs] == [
        (0, WcStatus.WR_FLUSH_ERR, 0, qp.qp_num),
        (1, WcStatus.WR_FLUSH_ERR, 0, qp.qp_num),
    ]
    qp.post_send(requests(pair, [W, W, W, W]))  # all four slots are free again, and no more
    with pytest.raises(SendQueueFull, match="1 requests, 0 free slots of 4"):
        qp.post_send(requests(pair, [W]))


def test_the_successes_of_a_second_run_wait_for_the_next_completion(pairs: PairFactory) -> None:
    pair = pairs(sq_depth=6)
    qp = pair.a.qp
    qp.post_send(requests(pair, [W, W, R, R], [True, True, False, False]))  # a WRITE run, then a READ run
    qp.post_send(requests(pair, [W], first=4))  # covers the two READs
    wcs = pair.a.cq.poll(8)
    assert [(wc.wr_id, wc.opcode, wc.byte_len) for wc in wcs] == [(0, W, SIZE), (1, W, SIZE), (4, W, SIZE)]
    assert all(moved(pair, i, op) for i, op in enumerate([W, W, R, R, W]))
    qp.post_send(requests(pair, [W] * 6, [False] * 6))  # every slot is free again, and no more
    with pytest.raises(SendQueueFull, match="1 requests, 0 free slots of 6"):
        qp.post_send(requests(pair, [W]))


def test_the_smallest_queue_takes_one_request_of_one_sge(pairs: PairFactory) -> None:
    pair = pairs(sq_depth=1, max_sge=1)
    qp = pair.a.qp
    with pytest.raises(SendQueueFull, match=r"^2 requests, 1 free slots of 1$"):
        qp.post_send(requests(pair, [W, W]))
    with pytest.raises(InvalidArgument, match=f"^2 SGEs, qp {qp.qp_num} takes at most 1$"):
        qp.post_send([pair.wr(0, W, [(0, 8), (8, 8)], 0)])
    qp.post_send(requests(pair, [W]))
    assert statuses(pair.waiter.wait(1)) == [WcStatus.SUCCESS]


def test_a_chunk_of_empty_requests_succeeds_and_moves_nothing(pairs: PairFactory) -> None:
    pair = pairs()
    before = pair.b.buf.copy()
    wrs = [pair.wr(i, W, [(i * SIZE, 0)], i * SIZE) for i in range(4)]
    assert statuses(pair.run(wrs)) == [WcStatus.SUCCESS] * 4
    assert np.array_equal(pair.b.buf, before)


@pytest.mark.parametrize("op", [W, R], ids=["write", "read"])
def test_a_chunk_within_one_buffer_registered_at_both_ends_runs_in_posting_order(
    pairs: PairFactory, op: Opcode
) -> None:
    """Each request sees what the requests before it wrote: the chunk cannot be one gather and one scatter."""
    pair = pairs()
    shared = np.random.default_rng(7).integers(0, 256, 4096, dtype=np.uint8)
    a_mr, b_mr = pair.a.register(shared, Access.all()), pair.b.register(shared, Access.all())
    src, dst = (a_mr, b_mr) if op is W else (b_mr, a_mr)
    wrs = [WorkRequest(i, op, (Sge((a_mr.addr + (i if op is W else i + 1) * 64), 64, a_mr.lkey),),
                       b_mr.addr + (i + 1 if op is W else i) * 64, b_mr.rkey) for i in range(3)]  # fmt: skip
    expected = shared.copy()
    for i in range(3):  # block i + 1 of the buffer gets block i, one after another
        expected[(i + 1) * 64 : (i + 2) * 64] = expected[i * 64 : (i + 1) * 64]
    assert statuses(pair.run(wrs)) == [WcStatus.SUCCESS] * 3 and src is not dst
    assert np.array_equal(shared, expected)


# -- the quick path (one request of one SGE) and the general one agree; fault seams on a failed pair -----


FLUSH = WcStatus.WR_FLUSH_ERR


@pytest.mark.parametrize("op", [W, R], ids=["write", "read"])
def test_hold_keeps_a_single_request_of_one_sge_until_stepped(pairs: PairFactory, op: Opcode) -> None:
    pair = pairs(specific=HOLD)
    qp = pair.a.qp
    qp.post_send(requests(pair, [op]))  # the shape the quick path takes when nothing is held
    assert qp.held == 1 and polled(pair) == [] and not moved(pair, 0, op)
    assert qp.step() == 1 and qp.held == 0
    assert polled(pair) == [(0, WcStatus.SUCCESS, op, SIZE)] and moved(pair, 0, op)


@pytest.mark.parametrize("op", [W, R], ids=["write", "read"])
def test_every_sge_of_a_single_request_is_checked_even_an_empty_last_one(pairs: PairFactory, op: Opcode) -> None:
    """Two SGEs whose first holds the whole length: the empty second one's unknown key still fails it."""
    pair = pairs()
    mr = pair.a.mr
    a_before, b_before = pair.a.buf.copy(), pair.b.buf.copy()
    bad = WorkRequest(0, op, (Sge(mr.addr, SIZE, mr.lkey), Sge(mr.addr + SIZE, 0, mr.lkey ^ 2)),
                      pair.b.mr.addr, pair.b.mr.rkey)  # fmt: skip
    pair.a.qp.post_send([bad])
    assert [(wc.status, wc.byte_len) for wc in pair.waiter.wait(1)] == [(WcStatus.LOC_PROT_ERR, 0)]
    assert np.array_equal(pair.a.buf, a_before) and np.array_equal(pair.b.buf, b_before)
    ok = pairs()
    good = WorkRequest(0, op, (Sge(ok.a.mr.addr, SIZE, ok.a.mr.lkey), Sge(ok.a.mr.addr + SIZE, 0, ok.a.mr.lkey)),
                       ok.b.mr.addr, ok.b.mr.rkey)  # fmt: skip
    ok.a.qp.post_send([good])
    assert [(wc.status, wc.byte_len) for wc in ok.waiter.wait(1)] == [(WcStatus.SUCCESS, SIZE)] and moved(ok, 0, op)


@pytest.mark.parametrize("op", [W, R], ids=["write", "read"])
def test_a_single_request_without_sges_succeeds_and_moves_nothing(pairs: PairFactory, op: Opcode) -> None:
    pair = pairs()
    a_before, b_before = pair.a.buf.copy(), pair.b.buf.copy()
    pair.a.qp.post_send([WorkRequest(7, op, (), pair.b.mr.addr, pair.b.mr.rkey)])
    assert [(wc.wr_id, wc.status, wc.opcode, wc.byte_len) for wc in pair.waiter.wait(1)] == [
        (7, WcStatus.SUCCESS, op, 0)
    ]
    assert np.array_equal(pair.a.buf, a_before) and np.array_equal(pair.b.buf, b_before)


def test_vanish_on_a_pair_already_in_err_leaves_held_requests_to_the_next_step(pairs: PairFactory) -> None:
    pair = pairs(specific=HOLD)
    qp = pair.a.qp
    qp.post_send(requests(pair, [W, R, W]))
    qp.fail_next(WcStatus.REM_ACCESS_ERR)
    assert qp.step(1) == 1 and qp.state == QpState.ERR and qp.held == 2
    assert polled(pair) == [(0, WcStatus.REM_ACCESS_ERR, W, 0)]
    qp.vanish()  # the peer dies after the pair failed: nothing happens now
    assert qp.held == 2 and qp.state == QpState.ERR and polled(pair) == []
    assert qp.step(5) == 2
    assert polled(pair) == [(1, FLUSH, R, 0), (2, FLUSH, W, 0)]
    assert not any(moved(pair, i, op) for i, op in enumerate([W, R, W]))


# -- lifecycle: closed, to_error, a closed passive pair --------------------------------------------------


def test_closed_is_false_until_close_then_true(pairs: PairFactory) -> None:
    pair = pairs()
    assert pair.a.qp.closed is False and pair.b.qp.closed is False
    pair.a.qp.close()
    assert pair.a.qp.closed is True and pair.b.qp.closed is False


def test_to_error_flushes_every_held_request_at_once(pairs: PairFactory) -> None:
    pair = pairs(specific=HOLD)
    qp = pair.a.qp
    qp.post_send(requests(pair, [W, R]))
    qp.post_send(requests(pair, [W], first=2))
    assert qp.held == 3
    qp.to_error()
    assert qp.held == 0 and qp.state == QpState.ERR
    assert polled(pair) == [(0, FLUSH, W, 0), (1, FLUSH, R, 0), (2, FLUSH, W, 0)]
    assert not any(moved(pair, i, op) for i, op in enumerate([W, R, W]))
    assert qp.step(5) == 0 and polled(pair) == []


def test_a_closed_passive_pair_leaves_its_fabric() -> None:
    fabric = MockFabric()
    backend = open_backend("mock", make_options("mock", specific=MockOptions(fabric=fabric)))
    try:
        passive = backend.create_qp(backend.create_cq(8))
        passive.connect({"accepting": False})  # waits for a dial by its token
        token = str(passive.endpoint()["token"])
        passive.close()
        assert fabric.claim(token) is None  # forgotten: the fabric holds no closed pair
        waiting = backend.create_qp(backend.create_cq(8))
        waiting.connect({"accepting": False})
        other = str(waiting.endpoint()["token"])
        assert fabric.claim(other) is waiting  # one that is not closed still waits there
    finally:
        backend.close()


def test_post_one_is_post_of_the_one_request_batch(pairs: PairFactory) -> None:
    """``post_one`` (the runtime's single read or write) ends as ``post`` of ``WorkBatch.one``: the same
    bytes and completion when it succeeds, the same failure when a check fails, the same refusal of an
    opcode no backend knows, and held requests still wait for ``step``."""
    for op in (W, R):
        results = []
        for how in ("one", "batch"):
            pair = pairs()
            a, b = pair.a.mr, pair.b.mr
            args = (3, op, a.addr, a.lkey, b.addr + SIZE // 2, b.rkey, SIZE // 2)
            if how == "one":
                pair.a.qp.post_one(*args)
            else:
                pair.a.qp.post(WorkBatch.one(*args))
            results.append(([(wc.wr_id, wc.status, wc.byte_len) for wc in pair.waiter.wait(1)], moved(pair, 0, op)))
            bad = (4, op, a.addr, a.lkey ^ 2, b.addr, b.rkey, 8)  # an unknown local key
            pair.a.qp.post_one(*bad)
            results.append([(wc.wr_id, wc.status) for wc in pair.waiter.wait(1)])
        assert results[0] == results[2] and results[1] == results[3] == [(4, WcStatus.LOC_PROT_ERR)]
    pair = pairs()
    with pytest.raises(InvalidArgument, match="unsupported opcode 9"):
        pair.a.qp.post_one(1, 9, pair.a.mr.addr, pair.a.mr.lkey, pair.b.mr.addr, pair.b.mr.rkey, 8)  # type: ignore[arg-type]
    held = pairs(specific=HOLD)
    held.a.qp.post_one(1, W, held.a.mr.addr, held.a.mr.lkey, held.b.mr.addr, held.b.mr.rkey, 8)
    assert held.a.qp.held == 1 and polled(held) == []
    assert held.a.qp.step() == 1 and [wc.status for wc in held.waiter.wait(1)] == [WcStatus.SUCCESS]
