"""Transfer uids, the target's inbound statuses, Session.alive and deregister_remote_engine (issue 10, item 3)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest

from moriio_async import (
    EngineClosed,
    InvalidArgument,
    IOEngine,
    IOEngineConfig,
    MockOptions,
    StatusCode,
    TransferFailed,
    WcStatus,
)
from moriio_async.control.inbound import InboundStatuses
from moriio_async.engine.uids import TransferUids

from ..control import wire
from .conftest import Pair, make_pair


async def settled(engine: IOEngine, peer: IOEngine, marker: bytes = b"marker") -> None:
    """Wait until every notice ``peer`` sent ``engine`` before now has been handled (notices keep their order)."""
    await peer.notify(engine.key, marker)
    note = await engine.recv_notification(timeout=5)
    assert note.data == marker


def test_allocated_uids_skip_the_ones_in_flight() -> None:
    uids = TransferUids()
    assert [uids.allocate() for _ in range(3)] == [0, 1, 2]
    uids.claim(3)  # a caller's own uid, in flight
    assert uids.allocate() == 4
    with pytest.raises(InvalidArgument, match="still in flight"):
        uids.claim(3)
    uids.release(3)
    assert uids.claim(3) == 3


async def test_uid_round_trip_for_every_transfer_call(pair: Pair) -> None:
    a, b, s = pair.a, pair.b, pair.session
    uids = [a.allocate_transfer_uid() for _ in range(4)]
    assert len(set(uids)) == 4
    transfers = [
        s.read(0, 0, 64, uid=uids[0]),
        s.write(0, 64, 64, uid=uids[1]),
        s.batch_read([0, 256], [0, 512], [64, 64], uid=uids[2]),
        s.batch_write([0, 256], [1024, 4096], [64, 64], uid=uids[3]),
    ]
    assert [t.uid for t in transfers] == uids
    await a.waiting_for_transfer_complete(transfers, timeout=10)
    for uid in uids:
        assert await b.wait_inbound_transfer_status("a", uid, timeout=5) is StatusCode.SUCCESS
        assert b.pop_inbound_transfer_status("a", uid) is None  # returned once
    assert b.pop_inbound_transfer_status("someone-else", uids[0]) is None
    assert b.statistics().inbound.statuses == 0
    assert a.statistics().uids_in_flight == 0


async def test_transfers_without_a_uid_send_nothing(pair: Pair) -> None:
    t = pair.session.write(0, 0, 64)
    assert t.uid is None
    await t
    await settled(pair.b, pair.a)
    assert pair.b.statistics().inbound.statuses == 0


async def test_a_caller_chosen_uid_works_and_may_be_reused_once_ended(pair: Pair) -> None:
    for _ in range(2):
        await pair.session.write(0, 0, 8, uid=(1 << 64) - 1)
        assert await pair.b.wait_inbound_transfer_status("a", (1 << 64) - 1, timeout=5) is StatusCode.SUCCESS


async def test_a_uid_in_flight_is_refused_and_posts_nothing(held: Pair) -> None:
    qp = held.session.channel.qp
    t = held.session.read(0, 0, 64, uid=7)
    posted = held.session.channel.posted
    for call in (
        lambda: held.session.write(0, 0, 64, uid=7),
        lambda: held.session.batch_read([0], [0], [64], uid=7),
    ):
        with pytest.raises(InvalidArgument, match="uid 7 is still in flight"):
            call()
    assert held.session.channel.posted == posted and held.a.outstanding == 1
    qp.step(1)  # type: ignore[attr-defined]
    await t
    again = held.session.write(0, 0, 64, uid=7)  # ended: free again
    qp.step(1)  # type: ignore[attr-defined]
    await again


@pytest.mark.parametrize("bad", [-1, 1 << 64, True, 1.0, "1"])
async def test_a_value_that_is_no_uid_is_refused(held: Pair, bad: object) -> None:
    with pytest.raises(InvalidArgument, match="transfer uid"):
        held.session.write(0, 0, 64, uid=bad)  # type: ignore[arg-type]
    assert held.a.outstanding == 0 and held.session.channel.posted == 0


async def test_a_call_refused_for_bad_input_leaves_its_uid_free(pair: Pair) -> None:
    """The uid is claimed only once the input passed every check: a refused call must not keep uid 5."""
    s, size = pair.session, pair.desc_b.length
    refused = [
        lambda: s.write(0, 0, 0, uid=5),  # empty block
        lambda: s.read(-1, 0, 8, uid=5),
        lambda: s.write(0, size, 8, uid=5),  # past the remote region
        lambda: s.read(0, 0, size + 1, uid=5),  # bigger than either region
        lambda: s.batch_write([0, 8], [0], [8, 8], uid=5),  # lists of different lengths
        lambda: s.batch_read([0, 64], [0, size], [64, 64], uid=5),  # the second block past the remote region
        lambda: s.batch_write([0], [0], [-8], uid=5),
        lambda: s.batch_read([0, 8], [0, 8], [8, "8"], uid=5),  # type: ignore[list-item]
    ]
    for call in refused:
        with pytest.raises(InvalidArgument):
            call()
        assert pair.a.statistics().uids_in_flight == 0
    t = s.batch_write([0, 64], [0, 64], [8, 8], uid=5)  # free: the first good call with it goes through
    await t
    assert t.uid == 5
    assert await pair.b.wait_inbound_transfer_status("a", 5, timeout=5) is StatusCode.SUCCESS


async def test_a_failed_transfer_announces_its_failure(held: Pair) -> None:
    qp = held.session.channel.qp
    qp.fail_next(WcStatus.REM_ACCESS_ERR)  # type: ignore[attr-defined]
    t = held.session.write(0, 0, 64, uid=41)
    qp.step(1)  # type: ignore[attr-defined]
    with pytest.raises(TransferFailed):
        await t
    assert t.code is StatusCode.ERR_RDMA_OP
    assert await held.b.wait_inbound_transfer_status("a", 41, timeout=5) is StatusCode.ERR_RDMA_OP


async def test_inbound_statuses_are_bounded_per_initiator_oldest_dropped() -> None:
    a, b, p = await make_pair("mock", max_inbound_statuses=3)
    try:
        await a.waiting_for_transfer_complete([p.session.write(0, 0, 8, uid=u) for u in range(5)], timeout=5)
        await settled(b, a)
        assert [b.pop_inbound_transfer_status("a", u) for u in range(5)] == [None, None] + [StatusCode.SUCCESS] * 3
        assert b.statistics().inbound.dropped == 2
    finally:
        await a.close()
        await b.close()


async def test_announce_transfer_without_a_transfer(pair: Pair) -> None:
    pair.a.announce_transfer("b", 99)
    pair.a.announce_transfer("b", 100, StatusCode.ERR_BAD_STATE)
    pair.a.announce_transfer("nobody", 101)  # unknown peer: nothing to tell
    with pytest.raises(InvalidArgument):
        pair.a.announce_transfer("b", 102, StatusCode.IN_PROGRESS)
    assert await pair.b.wait_inbound_transfer_status("a", 99, timeout=5) is StatusCode.SUCCESS
    assert await pair.b.wait_inbound_transfer_status("a", 100, timeout=5) is StatusCode.ERR_BAD_STATE


async def test_one_waiter_per_inbound_status(pair: Pair) -> None:
    first = asyncio.ensure_future(pair.b.wait_inbound_transfer_status("a", 5, timeout=5))
    await asyncio.sleep(0)
    with pytest.raises(InvalidArgument, match="already waits"):
        await pair.b.wait_inbound_transfer_status("a", 5, timeout=5)
    with pytest.raises(TimeoutError):
        await pair.b.wait_inbound_transfer_status("a", 6, timeout=0.01)
    await pair.session.write(0, 0, 8, uid=5)
    assert await first is StatusCode.SUCCESS
    assert pair.b.pop_inbound_transfer_status("a", 5) is None  # the waiter took it


async def test_the_table_files_only_terminal_codes_and_forgets_a_restarted_peer() -> None:
    table = InboundStatuses(max_per_peer=8)
    assert not table.record("p", 1, StatusCode.IN_PROGRESS)
    assert not table.record("p", 1, 99)
    assert table.record("p", 1, StatusCode.SUCCESS) and table.record("p", 2, StatusCode.ERR_RDMA_OP)
    table.forget("p")
    assert table.pop("p", 1) is None and len(table) == 0


def test_a_dropped_status_is_logged_naming_it_the_counts_and_both_bounds(caplog: pytest.LogCaptureFixture) -> None:
    """The operator reads which entry went, how many so far, both settings that bound the table, and
    what takes entries; at a halving rate (the 1st, 2nd, 4th... drop)."""
    table = InboundStatuses(max_per_peer=2, max_bytes=1 << 20)
    with caplog.at_level(logging.WARNING, logger="moriio_async"):
        for uid in range(6):  # uids 0..3 dropped in turn
            assert table.record("initiator-a", uid, StatusCode.SUCCESS)
    assert [r.getMessage() for r in caplog.records] == [
        f"inbound status of initiator-a uid {uid} dropped unpopped ({n} dropped so far, 0 for the byte bound): at "
        "most 2 are kept per initiator (max_inbound_statuses) and 1048576 bytes in all (max_inbound_status_bytes); "
        "pop_inbound_transfer_status takes them"
        for uid, n in ((0, 1), (1, 2), (3, 4))
    ]
    assert (table.dropped, table.dropped_for_bytes, len(table)) == (4, 0, 2)


async def test_a_wait_that_was_cancelled_leaves_its_place_to_the_next_one() -> None:
    """One waiter per (peer, uid) at a time: once a wait gave up, another may wait, and gets the entry."""
    table = InboundStatuses(max_per_peer=8)
    gave_up = asyncio.ensure_future(table.wait("p", 5))
    await asyncio.sleep(0)
    gave_up.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await gave_up
    again = asyncio.ensure_future(table.wait("p", 5))
    await asyncio.sleep(0)
    assert table.record("p", 5, StatusCode.ERR_RDMA_OP)
    assert await again is StatusCode.ERR_RDMA_OP
    assert table.pop("p", 5) is None and len(table) == 0  # taken by the waiter


async def test_a_restarted_initiator_starts_with_no_statuses(backend: str) -> None:
    cfg = IOEngineConfig(backend=backend)
    async with IOEngine("b", cfg) as b, IOEngine("a", cfg) as a:
        b.register_memory(bytearray(64), name="kv")
        desc = a.register_memory(bytearray(64))
        session = await a.create_session(desc, (await a.connect(b.address)).memory["kv"])
        await session.write(0, 0, 8, uid=0)
        assert await b.wait_inbound_transfer_status("a", 0, timeout=5) is StatusCode.SUCCESS
        await session.write(0, 0, 8, uid=1)
        await settled(b, a)
        await a.close()
        async with IOEngine("a", cfg) as a2:  # same key, new incarnation: its uid 1 is another transfer
            await a2.connect(b.address)
            await settled(b, a2)
            assert b.pop_inbound_transfer_status("a", 1) is None


async def test_a_transfer_to_a_restarted_target_is_not_filed_by_its_new_incarnation() -> None:
    """A transfer with uid 3 to b's first incarnation ends after b restarted (same key, same uids to come):
    its done notice belongs to the engine that is gone, never to the new one."""
    a, b, p = await make_pair("mock", mock=MockOptions(hold=True))
    b2: IOEngine | None = None
    try:
        qp = p.session.channel.qp
        t = p.session.write(0, 0, 64, uid=3)
        await b.close()
        b2 = await IOEngine("b", IOEngineConfig(backend="mock")).start()
        b2.register_memory(bytearray(64), name="kv")
        await a.connect(b2.address)  # a now knows b by its new incarnation
        assert not t.done()
        qp.step(1)  # type: ignore[attr-defined]
        with contextlib.suppress(TransferFailed):  # b1's memory is gone: how it ends does not matter
            await asyncio.wait_for(t, 5)
        await settled(b2, a)
        assert b2.pop_inbound_transfer_status("a", 3) is None
        assert b2.statistics().inbound.statuses == 0
    finally:
        await a.close()
        if b2 is not None:
            await b2.close()


async def test_session_alive(pair: Pair) -> None:
    s = pair.session
    assert s.alive()
    await s.abort()  # the pair is failed until the next transfer reconnects
    assert not s.alive()
    await s.write(0, 0, 8)
    assert s.alive()
    await pair.b.close()  # the peer goes: its control link closes
    async with asyncio.timeout(5):
        while s.alive():  # noqa: ASYNC110 (polls session state)
            await asyncio.sleep(0.01)
    await s.close()
    assert not s.alive()


async def test_deregister_remote_engine_leaves_transfers_in_flight_alone(held: Pair) -> None:
    a, b, s = held.a, held.b, held.session
    qp = s.channel.qp
    in_flight = [s.read(0, 0, 64, uid=1), s.write(0, 64, 64)]
    a.deregister_remote_engine("b")
    a.deregister_remote_engine("nobody")  # unknown: ignored, as in MoRI-IO
    qp.step(2)  # type: ignore[attr-defined]
    await a.waiting_for_transfer_complete(in_flight, timeout=5)
    assert await b.wait_inbound_transfer_status("a", 1, timeout=5) is StatusCode.SUCCESS  # still announced
    later = s.write(0, 0, 64)  # the open session keeps working
    qp.step(1)  # type: ignore[attr-defined]
    await later
    assert s.alive()
    with pytest.raises(InvalidArgument, match="'b' was deregistered"):
        await a.create_session(held.desc_a, s.remote)
    with pytest.raises(InvalidArgument, match="deregistered"):
        await a.notify("b", b"x")
    await b.notify("a", b"the peer still reaches us")  # its side is untouched
    assert (await a.recv_notification(timeout=5)).data == b"the peer still reaches us"
    a.register_remote_engine(b.get_engine_desc())  # named again: usable again
    again = await a.create_session(held.desc_a, s.remote)
    t = again.write(0, 0, 8)
    again.channel.qp.step(1)  # type: ignore[attr-defined]
    await t
    a.deregister_remote_engine(b.get_engine_desc())
    await a.connect(b.address)  # connect() names it again too
    await a.notify("b", b"back")


async def test_the_done_notice_goes_before_a_notification_sent_after_the_transfer(pair: Pair) -> None:
    for uid in range(20):
        await pair.session.write(0, 0, 64, uid=uid)
        await pair.a.notify("b", b"written")  # the application's own message, once the transfer ended
        assert (await pair.b.recv_notification(timeout=5)).data == b"written"
        assert pair.b.pop_inbound_transfer_status("a", uid) is StatusCode.SUCCESS  # already there, no wait


async def test_done_frames_from_a_hand_made_peer(backend: str) -> None:
    async with IOEngine("b", IOEngineConfig(backend=backend)) as b:
        peer = await wire.hello(b.address, "rogue", backend=backend)
        assert peer.welcomed
        await peer.send(
            {"op": "done", "uid": 6, "code": 2},  # IN_PROGRESS is no way to end: not filed
            {"op": "done", "uid": 5, "code": 0},
            {"op": "notify", "data": wire.b64(b"after")},
        )
        assert (await b.recv_notification(timeout=5)).data == b"after"
        assert b.pop_inbound_transfer_status("rogue", 5) is StatusCode.SUCCESS
        assert b.pop_inbound_transfer_status("rogue", 6) is None
        await peer.close()


async def test_a_deregistered_peer_stays_forgotten_when_a_new_incarnation_says_hello(backend: str) -> None:
    async with IOEngine("b", IOEngineConfig(backend=backend)) as b:
        first = await wire.hello(b.address, "x", incarnation=1, backend=backend)
        b.deregister_remote_engine("x")
        second = await wire.hello(b.address, "x", incarnation=2, backend=backend)  # x restarted and dialed b
        assert second.welcomed
        with pytest.raises(InvalidArgument, match="deregistered"):
            await b.notify("x", b"no")
        for client in (first, second):
            await client.close()


async def test_closing_the_engine_ends_a_wait_for_an_inbound_status(pair: Pair) -> None:
    waiting = asyncio.ensure_future(pair.b.wait_inbound_transfer_status("a", 1))
    await asyncio.sleep(0)
    await pair.b.close()
    with pytest.raises(EngineClosed):
        await waiting


async def test_done_notices_to_a_peer_that_stops_reading_are_dropped_not_buffered(backend: str) -> None:
    async with IOEngine("b", IOEngineConfig(backend=backend)) as b:
        peer = await wire.hello(b.address, "deaf", backend=backend)  # says hello, then never reads again
        for uid in range(400_000):  # ~16 MB of notices: more than the socket buffers and DONE_BACKLOG
            b.announce_transfer("deaf", uid)
            if uid % 1000 == 999:
                await asyncio.sleep(0)  # let each burst be written
                if b.statistics().inbound.done_dropped:
                    break
        assert b.statistics().inbound.done_dropped > 0
        await peer.close()


async def test_statuses_of_pruned_peers_go_with_them(backend: str) -> None:
    """Without a secret anyone may say hello under any key: what they file is bounded by max_peers too."""
    async with IOEngine("b", IOEngineConfig(backend=backend, max_peers=2, max_inbound_statuses=2)) as b:
        for i in range(5):
            peer = await wire.hello(b.address, f"p{i}", backend=backend)
            await peer.send(*({"op": "done", "uid": u, "code": 0} for u in range(4)))
            await peer.send({"op": "notify", "data": wire.b64(b"sync")})
            assert (await b.recv_notification(timeout=5)).data == b"sync"
            await peer.close()
        await wire.until(lambda: b.statistics().peers.peers <= 2)
        assert b.statistics().inbound.statuses <= 2 * 2
        assert b.pop_inbound_transfer_status("p4", 3) is StatusCode.SUCCESS  # the latest peer's are kept
