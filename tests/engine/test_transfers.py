"""Engine-level conformance: written once, run against every backend in MORIIO_TEST_ENGINE_BACKENDS."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from moriio_async import (
    IOEngine,
    IOEngineConfig,
    StalePeer,
    StatusCode,
    TransferError,
    TransferFailed,
    WcStatus,
    waiting_for_transfer_complete,
)

from .conftest import Pair, make_pair


@pytest.mark.parametrize("size", [1, 7, 4096, 65536, 1 << 20])
async def test_read_and_write_are_byte_identical(pair: Pair, size: int) -> None:
    await pair.session.read(0, 0, size)
    assert np.array_equal(pair.buf_a[:size], pair.buf_b[:size])
    pair.buf_a[:size] = 0xA5
    await pair.session.write(0, 0, size)
    assert (pair.buf_b[:size] == 0xA5).all()


async def test_batch_read_scatters_blocks_and_returns_one_status(pair: Pair) -> None:
    block = 4096
    local = [i * 2 * block for i in range(32)]  # local scattered, remote contiguous
    remote = [i * block for i in range(32)]
    t = pair.session.batch_read(local, remote, [block] * 32)
    await waiting_for_transfer_complete([t], timeout=10)
    assert t.Succeeded() and t.Code() == 0 and t.Message() == ""
    for lo, ro in zip(local, remote, strict=True):
        assert np.array_equal(pair.buf_a[lo : lo + block], pair.buf_b[ro : ro + block])


async def test_batch_write_then_read_back_round_trip(pair: Pair) -> None:
    rng = np.random.default_rng(1)
    pair.buf_a[:] = rng.integers(0, 256, pair.buf_a.size, dtype=np.uint8)
    original = pair.buf_a.copy()
    n, block = 64, 16384
    offs = [i * block for i in range(n)]
    await pair.session.batch_write(offs, offs[::-1], [block] * n)
    pair.buf_a[:] = 0
    await pair.session.batch_read(offs[::-1], offs, [block] * n)
    # block i went to remote slot n-1-i, and remote slot n-1-i came back to local slot i
    assert np.array_equal(pair.buf_a[: n * block], original[: n * block])


async def test_more_transfers_than_send_queue_slots_all_succeed_in_order(backend: str) -> None:
    a, b, p = await make_pair(backend, sq_depth=8)
    try:
        done_order: list[int] = []
        ts = [p.session.write(i * 64, i * 64, 64) for i in range(200)]
        for t in ts:
            t.add_done_callback(lambda t: done_order.append(t.id))
        await waiting_for_transfer_complete(ts, timeout=20)
        assert done_order == [t.id for t in ts]
        stats = p.session.statistics()
        assert stats.max_in_flight <= 8
        assert stats.in_flight == 0 and stats.waiting == 0
        assert a.outstanding == 0
    finally:
        await a.close()
        await b.close()


async def test_notification_after_write_sees_the_data(pair: Pair) -> None:
    for round_ in range(5):
        pair.buf_a[:4096] = round_ + 1
        await pair.session.write(0, 0, 4096)
        await pair.a.notify("b", f"write_done {round_}".encode())
        note = await pair.b.recv_notification(timeout=5)
        assert note.peer == "a" and note.data == f"write_done {round_}".encode()
        assert (pair.buf_b[:4096] == round_ + 1).all()


async def test_notifications_arrive_in_order_both_ways(pair: Pair) -> None:
    for i in range(50):
        await pair.a.notify("b", bytes([i]))
        await pair.b.notify("a", bytes([i]))
    got_b = [(await pair.b.recv_notification(timeout=5)).data[0] for _ in range(50)]
    got_a = [(await pair.a.recv_notification(timeout=5)).data[0] for _ in range(50)]
    assert got_b == list(range(50)) and got_a == list(range(50))


async def test_deregistered_remote_region_fails_with_remote_access_error(pair: Pair) -> None:
    before = pair.buf_b.copy()
    pair.b.deregister_memory(pair.desc_b)
    pair.buf_a[:] = 0xEE
    t = pair.session.write(0, 0, 4096)
    with pytest.raises(TransferError) as info:
        await waiting_for_transfer_complete([t], timeout=10)
    (failure,) = info.value.failed
    assert failure.wc_status is WcStatus.REM_ACCESS_ERR
    assert t.Failed() and t.Code() == StatusCode.ERR_RDMA_OP
    assert "REM_ACCESS_ERR" in t.Message()
    assert np.array_equal(pair.buf_b, before)


async def test_failed_pair_is_replaced_for_later_transfers(pair: Pair) -> None:
    other = np.zeros(8192, dtype=np.uint8)
    pair.b.register_memory(other, name="other")
    pair.b.deregister_memory(pair.desc_b)
    with pytest.raises(TransferFailed):
        await pair.session.read(0, 0, 16)
    first_qp = pair.session.statistics().qp_num
    # The region is still gone, but the failure must come from a fresh queue pair.
    with pytest.raises(TransferFailed) as info:
        await pair.session.read(0, 0, 16)
    assert info.value.wc_status is WcStatus.REM_ACCESS_ERR
    assert pair.session.statistics().qp_num != first_qp
    peer = await pair.a.connect(pair.b.address)
    s2 = await pair.a.create_session(pair.desc_a, peer.memory["other"])
    other[:] = 9
    await s2.read(0, 0, 8192)
    assert (pair.buf_a[:8192] == 9).all()


async def test_restarted_peer_is_detected_as_stale(backend: str) -> None:
    a, b, p = await make_pair(backend)
    try:
        old_desc = p.session.remote
        await b.close()
        b2 = await IOEngine("b", IOEngineConfig(backend=backend, port=int(b.address.rsplit(":", 1)[1]))).start()
        try:
            b2.register_memory(np.zeros(1 << 20, dtype=np.uint8), name="kv")
            t = p.session.read(0, 0, 64)
            with pytest.raises(TransferFailed):
                await t.wait(10)
            t2 = p.session.read(0, 0, 64)
            with pytest.raises(TransferFailed) as info:
                await t2.wait(10)
            assert info.value.code is StatusCode.ERR_BAD_STATE
            assert "restarted" in str(info.value)
            with pytest.raises(StalePeer):
                await a.create_session(p.desc_a, old_desc)
            fresh = await a.connect(b2.address)
            assert fresh.engine.incarnation != old_desc.incarnation
            s2 = await a.create_session(p.desc_a, fresh.memory["kv"])
            await s2.read(0, 0, 64)
        finally:
            await b2.close()
    finally:
        await a.close()
        await b.close()


async def test_abort_ends_every_transfer_and_releases_pins(pair: Pair) -> None:
    ts = [pair.session.write(0, 0, 1 << 20) for _ in range(20)]
    await pair.session.abort()
    assert all(t.done() for t in ts)
    assert all(t.Succeeded() or (t.error() is not None and t.error().wc_status is not None) for t in ts)
    assert pair.a.outstanding == 0
    pair.a.deregister_memory(pair.desc_a)  # no pins left: must not raise


async def test_session_works_again_after_abort(pair: Pair) -> None:
    pair.session.write(0, 0, 4096)
    await pair.session.abort()
    # Bytes of the aborted write may still land at the target (as with RDMA): read elsewhere.
    pair.buf_b[8192 : 8192 + 64] = 3
    await pair.session.read(8192, 8192, 64)
    assert (pair.buf_a[8192 : 8192 + 64] == 3).all()


async def test_many_sessions_share_one_completion_reader(pair: Pair) -> None:
    peer = await pair.a.connect(pair.b.address)
    sessions = [await pair.a.create_session(pair.desc_a, peer.memory["kv"]) for _ in range(4)]
    ts = [s.read(i * 4096, i * 4096, 4096) for i in range(64) for s in sessions[i % 4 : i % 4 + 1]]
    await asyncio.wait_for(waiting_for_transfer_complete(ts, timeout=10), 15)
    assert np.array_equal(pair.buf_a[: 64 * 4096], pair.buf_b[: 64 * 4096])


async def test_the_callers_arrays_can_be_reused_once_a_batch_is_posted(held: Pair) -> None:
    """int64 arrays are planned without a copy, but the transfer keeps what was posted: a caller that
    refills its offset arrays for the next batch changes neither the bytes moved nor the report."""
    lo = np.array([0, 8192, 4096], dtype=np.int64)
    ro = np.array([4096, 0, 8192], dtype=np.int64)
    sz = np.array([64, 128, 256], dtype=np.int64)
    held.buf_a[:] = np.arange(held.buf_a.size, dtype=np.uint64).astype(np.uint8)
    t = held.session.batch_write(lo, ro, sz)
    lo[:] = 1
    ro[:] = 2
    sz[:] = 3
    held.session.channel.qp.step(3)  # type: ignore[attr-defined]
    await t
    assert t.local_offsets == (0, 8192, 4096)
    assert t.remote_offsets == (4096, 0, 8192)
    assert t.sizes == (64, 128, 256)
    for a, b, n in zip((0, 8192, 4096), (4096, 0, 8192), (64, 128, 256), strict=True):
        assert np.array_equal(held.buf_b[b : b + n], held.buf_a[a : a + n])


async def test_singles_posted_in_one_pass_behind_one_in_flight_each_move_their_own_bytes(pair: Pair) -> None:
    """On tcp the singles of one loop pass behind a request in flight go out as one batch: reads and
    writes interleaved, each still lands its own bytes and ends as its own transfer."""
    block, n = 2048, 48
    first = pair.session.read(0, 0, block)
    ts = []
    for i in range(1, n):
        at = i * block
        if i % 2:
            ts.append(pair.session.read(at, at, block))
        else:
            pair.buf_a[at : at + block] = i
            ts.append(pair.session.write(at, (1 << 19) + at, block))
    await waiting_for_transfer_complete([first, *ts], timeout=10)
    assert all(t.Succeeded() for t in [first, *ts]) and len({t.id for t in ts}) == n - 1
    for i in range(1, n):
        at = i * block
        if i % 2:
            assert (pair.buf_a[at : at + block] == pair.buf_b[at : at + block]).all(), i
        else:
            assert (pair.buf_b[(1 << 19) + at : (1 << 19) + at + block] == i).all(), i
