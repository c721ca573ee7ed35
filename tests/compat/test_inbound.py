"""Transfer uids end to end: the target learns of an initiator's finished transfer (pop_inbound_transfer_status)."""

from __future__ import annotations

import time

import pytest

from moriio_async.compat.mori import IOEngine, RdmaBackendConfig, StatusCode, TransferStatus

from .conftest import make_pair, register


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
        assert inbound is not None and inbound.Succeeded()
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
    with pytest.raises(ValueError, match="prefix"):
        a.notify(b.key, b"\x00moriio-compat:inbound\x00" + bytes(8))
