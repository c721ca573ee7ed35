"""The target's inbound statuses are bounded in bytes across all initiators (issue 23, item 6)."""

from __future__ import annotations

import asyncio
import sys
import tracemalloc

import pytest

from moriio_async import StatusCode
from moriio_async.control.inbound import ENTRY_BYTES, PEER_BYTES, InboundStatuses

from .conftest import make_pair
from .test_hooks import settled

CODES = (StatusCode.SUCCESS, StatusCode.ERR_RDMA_OP, StatusCode.ERR_BAD_STATE)


def hostile_keys(n: int) -> list[str]:
    """Fresh initiator keys, as anyone able to say hello without a secret could claim; some as long as allowed."""
    return [f"initiator-{i:05d}-" + "k" * (1000 if i % 7 == 0 else i % 40) for i in range(n)]


def test_many_initiators_filling_it_stay_under_the_bound_the_oldest_dropped_and_counted() -> None:
    bound = 256 << 10
    table = InboundStatuses(max_per_peer=4096, max_bytes=bound)
    keys = hostile_keys(1500)
    filed: list[tuple[str, int, StatusCode]] = []
    for round_ in range(6):  # round-robin: every initiator has a few, none reaches its own cap
        for i, key in enumerate(keys):
            uid = (round_ << 40) | i
            code = CODES[(round_ + i) % 3]
            assert table.record(key, uid, code)
            filed.append((key, uid, code))
            assert table.bytes <= bound
    kept = len(table)
    assert 0 < kept < len(filed)
    assert table.dropped == len(filed) - kept
    assert table.dropped_for_bytes == table.dropped  # all for the byte bound: no initiator hit its own cap
    # What remains is exactly the newest, and each pops once with its own code; the rest are gone.
    newest = filed[-kept:]
    for key, uid, _code in filed[: len(filed) - kept]:
        assert table.pop(key, uid) is None
    for key, uid, code in newest:
        assert table.pop(key, uid) is code
        assert table.pop(key, uid) is None
    assert len(table) == 0 and table.bytes == 0


def test_the_per_initiator_cap_stays_and_is_counted_apart() -> None:
    table = InboundStatuses(max_per_peer=8, max_bytes=64 << 20)
    for uid in range(20):
        table.record("a", uid, StatusCode.SUCCESS)
    table.record("b", 0, StatusCode.SUCCESS)
    assert len(table) == 9
    assert table.dropped == 12 and table.dropped_for_bytes == 0
    assert [table.pop("a", u) for u in range(20)] == [None] * 12 + [StatusCode.SUCCESS] * 8
    assert table.bytes == ENTRY_BYTES + PEER_BYTES + sys.getsizeof("b")


def test_the_accounted_bytes_cover_what_the_entries_really_take() -> None:
    """The bound is in accounted bytes; they must not undercount what CPython allocates."""
    for peers, per_peer in ((1, 1), (1, 3000), (2000, 1), (300, 17), (40, 700)):
        table = InboundStatuses(max_per_peer=4096, max_bytes=1 << 40)
        keys = hostile_keys(peers)
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for key in keys:
                for j in range(per_peer):
                    table.record(key, (1 << 63) + j * 7919, StatusCode.SUCCESS)
            used = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert used <= table.bytes, (peers, per_peer, used, table.bytes)


def test_a_refiled_uid_is_counted_once() -> None:
    table = InboundStatuses(max_per_peer=8, max_bytes=1 << 20)
    table.record("a", 1, StatusCode.SUCCESS)
    table.record("a", 1, StatusCode.ERR_RDMA_OP)
    assert len(table) == 1 and table.bytes == ENTRY_BYTES + PEER_BYTES + sys.getsizeof("a")
    assert table.pop("a", 1) is StatusCode.ERR_RDMA_OP
    table.forget("a")
    assert table.bytes == 0


def test_a_refiled_uid_is_young_again_the_oldest_other_goes_first() -> None:
    """Refiling renews an entry's age, per initiator and for the byte bound alike."""
    per_peer = InboundStatuses(max_per_peer=2, max_bytes=1 << 20)
    per_peer.record("a", 1, StatusCode.SUCCESS)
    per_peer.record("a", 2, StatusCode.SUCCESS)
    per_peer.record("a", 1, StatusCode.ERR_RDMA_OP)  # uid 1 is now the younger
    per_peer.record("a", 3, StatusCode.SUCCESS)  # over the bound: the oldest, uid 2, goes
    assert per_peer.pop("a", 2) is None
    assert per_peer.pop("a", 1) is StatusCode.ERR_RDMA_OP and per_peer.pop("a", 3) is StatusCode.SUCCESS
    one_each = ENTRY_BYTES + PEER_BYTES + sys.getsizeof("a")
    in_bytes = InboundStatuses(max_per_peer=8, max_bytes=2 * one_each)
    in_bytes.record("a", 1, StatusCode.SUCCESS)
    in_bytes.record("b", 1, StatusCode.SUCCESS)
    in_bytes.record("a", 1, StatusCode.ERR_RDMA_OP)  # a's entry is now the younger
    in_bytes.record("c", 1, StatusCode.SUCCESS)  # over the byte bound: the oldest in all, b's, goes
    assert in_bytes.pop("b", 1) is None
    assert in_bytes.pop("a", 1) is StatusCode.ERR_RDMA_OP


async def test_a_waiter_gets_its_code_however_full_the_table_is() -> None:
    table = InboundStatuses(max_per_peer=4096, max_bytes=8 << 10)
    waiter = asyncio.ensure_future(table.wait("late", 7))
    await asyncio.sleep(0)
    for i, key in enumerate(hostile_keys(200)):
        table.record(key, i, StatusCode.SUCCESS)
    assert table.bytes <= 8 << 10 and table.dropped > 0
    table.record("late", 7, StatusCode.ERR_BAD_STATE)
    assert await waiter is StatusCode.ERR_BAD_STATE
    assert table.pop("late", 7) is None  # the waiter took it
    dropped_key = hostile_keys(1)[0]
    assert table.pop(dropped_key, 0) is None  # dropped: a later wait waits for a notice that will not come
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.01):
            await table.wait(dropped_key, 0)


async def test_an_engine_keeps_its_inbound_statuses_under_max_inbound_status_bytes() -> None:
    two = PEER_BYTES + sys.getsizeof("a") + 2 * ENTRY_BYTES  # room for initiator "a" and two entries
    a, b, p = await make_pair("mock", max_inbound_status_bytes=two)
    try:
        await a.waiting_for_transfer_complete([p.session.write(0, 0, 8, uid=u) for u in range(5)], timeout=5)
        await settled(b, a)
        stats = b.statistics()
        assert stats.inbound.statuses == 2 and stats.inbound.status_bytes == two
        assert stats.inbound.dropped == 3 and stats.inbound.dropped_for_bytes == 3
        assert [b.pop_inbound_transfer_status("a", u) for u in range(5)] == [None] * 3 + [StatusCode.SUCCESS] * 2
        assert b.statistics().inbound.status_bytes == 0
    finally:
        await a.close()
        await b.close()
