"""The TCP backend's own machinery: its fault-injection seams, its handshake, what it describes."""

from __future__ import annotations

import pytest

from moriio_async.backends import open_backend
from moriio_async.backends.base import QpState
from moriio_async.backends.tcp import Fault, Hooks, VendorErr
from moriio_async.errors import InvalidArgument, MoriioError
from moriio_async.status import Opcode, WcStatus
from moriio_async.work import WorkRequest

from .harness import PairFactory, digest, make_options, statuses, wr_ids

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.only_backends("tcp", reason="tests the TCP backend's hooks, handshake and describe()"),
]


def test_on_send_hook_completes_a_request_with_a_chosen_status(pairs: PairFactory) -> None:
    class FailThird(Hooks):
        def on_send(self, qp_num: int, wr: WorkRequest) -> WcStatus | None:
            return WcStatus.REM_OP_ERR if wr.wr_id == 2 else None

    pair = pairs()
    pair.a.qp.hooks = FailThird()  # type: ignore[attr-defined]
    target = digest(pair.b.buf[2 * 4096 :])
    wcs = pair.run([pair.write(i, i * 4096, 4096, i * 4096, signaled=i != 1) for i in range(5)], expect=4)
    assert wr_ids(wcs) == [0, 2, 3, 4]
    assert statuses(wcs) == [WcStatus.SUCCESS, WcStatus.REM_OP_ERR, WcStatus.WR_FLUSH_ERR, WcStatus.WR_FLUSH_ERR]
    assert digest(pair.b.buf[2 * 4096 :]) == target


def test_on_send_hook_success_skips_the_wire(pairs: PairFactory) -> None:
    class Pretend(Hooks):
        def on_send(self, qp_num: int, wr: WorkRequest) -> WcStatus | None:
            return WcStatus.SUCCESS if wr.wr_id == 1 else None

    pair = pairs()
    pair.a.qp.hooks = Pretend()  # type: ignore[attr-defined]
    pair.a.buf[:] = 3
    wcs = pair.run([pair.write(0, 0, 4096, 0), pair.write(1, 4096, 4096, 4096), pair.write(2, 8192, 4096, 8192)])
    assert wr_ids(wcs) == [0, 1, 2] and set(statuses(wcs)) == {WcStatus.SUCCESS}
    assert (pair.b.buf[:4096] == 3).all() and not (pair.b.buf[4096:8192] == 3).all()


def test_on_response_hook_drop_is_a_dead_peer(pairs: PairFactory) -> None:
    class DropOnSecond(Hooks):
        def on_response(self, qp_num: int, wr: WorkRequest, status: WcStatus) -> Fault | None:
            return Fault.DROP if wr.wr_id == 1 else None

    pair = pairs()
    pair.a.qp.hooks = DropOnSecond()  # type: ignore[attr-defined]
    wcs = pair.run([pair.write(i, 0, 4096, 0) for i in range(4)], expect=4)
    assert statuses(wcs) == [WcStatus.SUCCESS, WcStatus.RETRY_EXC_ERR, WcStatus.WR_FLUSH_ERR, WcStatus.WR_FLUSH_ERR]
    assert pair.a.qp.state == QpState.ERR


def test_target_check_is_named_in_vendor_err(pairs: PairFactory) -> None:
    pair = pairs()
    [wc] = pair.run([pair.write(0, 0, 4096, pair.b.mr.length - 1)])
    assert wc.status is WcStatus.REM_ACCESS_ERR and wc.vendor_err == VendorErr.REMOTE_OUT_OF_BOUNDS


def test_describe_names_the_data_port(backend_name: str) -> None:
    backend = open_backend(backend_name, make_options(sq_depth=99))
    try:
        info = backend.describe()
        assert info["backend"] == "tcp" and info["sq_depth"] == 99
        assert info["host"] == "127.0.0.1" and isinstance(info["data_port"], int) and info["data_port"] > 0
    finally:
        backend.close()


def test_dial_with_a_token_nobody_expects_fails(backend_name: str) -> None:
    opts = make_options(connect_timeout=5.0)
    a, b = open_backend(backend_name, opts), open_backend(backend_name, opts)
    try:
        qa, qb = a.create_qp(a.create_cq(4)), b.create_qp(b.create_cq(4))
        qb.connect(qa.endpoint())
        endpoint = qb.endpoint()
        qb.close()  # the passive pair is gone before the active one dials
        with pytest.raises(MoriioError, match="refused"):
            qa.connect(endpoint)
        assert qa.state == QpState.INIT
    finally:
        a.close()
        b.close()


def test_passive_pair_refuses_posts(pairs: PairFactory) -> None:
    pair = pairs()
    with pytest.raises(InvalidArgument, match="passive"):
        pair.b.qp.post_send([WorkRequest(1, Opcode.RDMA_WRITE, (), pair.a.mr.addr, pair.a.mr.rkey)])
