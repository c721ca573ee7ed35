"""Transfer uids end to end: the target learns of an initiator's finished transfer (pop_inbound_transfer_status)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from moriio_async import WcStatus
from moriio_async.compat.mori import IOEngine, RdmaBackendConfig, StatusCode, TransferStatus

from .conftest import make_pair, on_loop, register


def wait_inbound(engine: IOEngine, key: str, uid: int, timeout: float = 5.0) -> TransferStatus | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = engine.pop_inbound_transfer_status(key, uid)
        if status:
            return status
        time.sleep(0.001)
    return None


def test_uid_round_trip_session_and_engine_level(pair: tuple[IOEngine, IOEngine]) -> None:
    a, b = pair
    _, mx = register(a, 4096)
    _, my = register(b, 4096)
    session = a.create_session(mx, my)
    assert session is not None
    uids = [session.allocate_transfer_uid() for _ in range(3)]
    assert len(set(uids)) == 3
    statuses = [
        session.batch_write([0, 2048], [0, 2048], [1024, 1024], uids[0]),
        session.read(0, 0, 64, uids[1]),
        a.write(mx, 0, my, 0, 4096, uids[2]),
    ]
    assert a.wait_all(statuses, 10_000) is StatusCode.SUCCESS
    for uid in uids:
        inbound = wait_inbound(b, a.key, uid)
        assert inbound is not None and inbound.Succeeded() and inbound.Message() == ""
        assert b.pop_inbound_transfer_status(a.key, uid) is None  # popped once
    assert b.pop_inbound_transfer_status(a.key, 10_000) is None
    assert b.pop_inbound_transfer_status("someone-else", uids[0]) is None
    # a caller-chosen uid works too, and an empty session batch is announced like any other
    assert session.batch_write([], [], [], 424242).Succeeded()
    assert wait_inbound(b, a.key, 424242) is not None


def test_failed_transfers_are_not_announced(pair: tuple[IOEngine, IOEngine]) -> None:
    a, b = pair
    _, mx = register(a, 64)
    _, my = register(b, 64)
    st = a.write(mx, 0, my, 60, 8, 77)
    assert st.Code() is StatusCode.ERR_INVALID_ARGS
    ok = a.write(mx, 0, my, 0, 8, 78)
    ok.Wait()
    assert wait_inbound(b, a.key, 78) is not None  # the later success arrived, the failure did not
    assert b.pop_inbound_transfer_status(a.key, 77) is None


def test_notification_disabled() -> None:
    a, b = make_pair("no-notif", "tcp", RdmaBackendConfig(enable_notification=False))
    try:
        _, mx = register(a, 64)
        _, my = register(b, 64)
        st = a.write(mx, 0, my, 0, 64, a.allocate_transfer_uid())
        st.Wait()
        assert st.Succeeded()
        a.notify(b.key, b"after the write")  # ordered after it: once this arrives, nothing else is coming
        assert b.recv_notification(5) == (a.key, b"after the write")
        assert b.pop_inbound_transfer_status(a.key, 0) is None
    finally:
        a.close()
        b.close()


def test_user_notifications_pass_and_inbound_ones_stay_hidden(pair: tuple[IOEngine, IOEngine]) -> None:
    a, b = pair
    _, mx = register(a, 64)
    _, my = register(b, 64)
    a.write(mx, 0, my, 0, 64, 5).Wait()
    a.notify(b.key, b"write_done")
    peer, data = b.recv_notification(5)
    assert (peer, data) == (a.key, b"write_done")  # the inbound message for uid 5 came first and was filed
    assert b.pop_inbound_transfer_status(a.key, 5) is not None
    with pytest.raises(TimeoutError):
        b.recv_notification(0.05)


def test_a_failure_after_posting_is_announced_with_its_code(held: tuple[IOEngine, IOEngine]) -> None:
    """MoRI-IO's target never hears of a failed transfer; here it learns the first failure's code."""
    a, b = held
    _, mx = register(a, 64 << 10)
    _, my = register(b, 64 << 10)
    session = a.create_session(mx, my)
    assert session is not None and len(session.stripes) == 2
    on_loop(a, session.stripes[1].channel.qp.fail_next, WcStatus.REM_ACCESS_ERR)
    status = session.batch_write([0, 8192], [0, 8192], [4096, 4096], 12)  # one post on each stripe
    for stripe in session.stripes:
        on_loop(a, stripe.channel.qp.step, 1 << 20)
    assert status.WaitFor(10_000) is StatusCode.ERR_RDMA_OP
    inbound = wait_inbound(b, a.key, 12)
    assert inbound is not None and inbound.Failed() and inbound.Code() is StatusCode.ERR_RDMA_OP
    assert inbound.Message() == f"transfer 12 failed at engine {a.key!r}"


def test_deregister_remote_engine_lets_engine_level_transfers_in_flight_end() -> None:
    """The engine-level session is dropped at once, but closed only once its transfer has ended."""
    a, b = make_pair("dereg", "tcp")
    try:
        x, mx = register(a, 16 << 20)
        y, my = register(b, 16 << 20, fill=0)
        assert a.write(mx, 0, my, 0, 8, 4).WaitFor(10_000) is StatusCode.SUCCESS  # the cached session is open
        st = a.write(mx, 0, my, 0, 16 << 20, 5)
        a.deregister_remote_engine(b.get_engine_desc())  # runs on the loop right after the post
        assert a.write(mx, 0, my, 0, 8, 6).Code() is StatusCode.ERR_BAD_STATE  # new work to it is refused
        assert st.WaitFor(30_000) is StatusCode.SUCCESS, st.Message()  # not aborted by the deregistration
        assert np.array_equal(x, y)
        assert wait_inbound(b, a.key, 5) is not None
    finally:
        a.close()
        b.close()


def test_a_transfer_made_before_deregister_remote_engine_still_runs() -> None:
    """Even when its engine-level session is still being opened when the peer is deregistered."""
    a, b = make_pair("dereg-open", "tcp")
    try:
        x, mx = register(a, 1 << 20)
        y, my = register(b, 1 << 20, fill=0)
        st = a.write(mx, 0, my, 0, 1 << 20, 8)  # accepted; its session opens on the loop
        a.deregister_remote_engine(b.get_engine_desc())
        assert st.WaitFor(30_000) is StatusCode.SUCCESS, st.Message()
        assert np.array_equal(x, y)
        assert a.create_session(mx, my) is None  # and afterwards the peer is forgotten
        assert a.write(mx, 0, my, 0, 8, 9).Code() is StatusCode.ERR_BAD_STATE
    finally:
        a.close()
        b.close()
