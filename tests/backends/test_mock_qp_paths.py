"""Whichever way the mock queue pair runs a post (the quick path of a single one-SGE request, or the
general one), the outcome is the same: every SGE checked, held requests kept until stepped. And the
fault seams on a pair that already failed: ``vanish`` then changes nothing, held requests still wait
for the test's next ``step`` and flush."""

from __future__ import annotations

import numpy as np
import pytest

from moriio_async.backends.base import QpState
from moriio_async.status import Opcode, WcStatus
from moriio_async.work import Sge, WorkRequest

from .harness import PairFactory
from .test_mock_qp import HOLD, SIZE, moved, polled, requests

pytestmark = [pytest.mark.timeout(60), pytest.mark.only_backends("mock", reason="the mock queue pair's seams")]

W, R = Opcode.RDMA_WRITE, Opcode.RDMA_READ
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
