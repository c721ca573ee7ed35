"""The mock queue pair's lifecycle: ``closed`` is a bool from the start, ``to_error`` flushes what
``hold`` kept, and a closed passive pair leaves its fabric (no dial reaches it, nothing keeps it)."""

from __future__ import annotations

import pytest

from moriio_async.backends import open_backend
from moriio_async.backends.base import QpState
from moriio_async.backends.mock import MockOptions
from moriio_async.backends.mock.fabric import MockFabric
from moriio_async.status import Opcode, WcStatus

from .harness import PairFactory, make_options
from .test_mock_qp import HOLD, moved, polled, requests

pytestmark = [pytest.mark.timeout(60), pytest.mark.only_backends("mock", reason="the mock queue pair's lifecycle")]

W, R = Opcode.RDMA_WRITE, Opcode.RDMA_READ
FLUSH = WcStatus.WR_FLUSH_ERR


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
    backend = open_backend("mock", make_options(specific=MockOptions(fabric=fabric)))
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
