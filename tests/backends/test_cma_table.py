"""The cma region table's keys and slots, as the owner keeps them and an initiator's view reads them: a key
never comes back, a slot is reused only through its own key's release, the table holds a bounded number of
regions, and a view maps only a table sealed against peers' writes."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import numpy as np
import pytest

from moriio_async.backends.cma.table import (
    CLOSED,
    LIVE,
    READ,
    RECORD,
    SLOTS,
    WRITE,
    RegionTable,
    TableView,
    seal_fd,
    seal_writes,
)
from moriio_async.backends.cma.wire import VendorErr
from moriio_async.errors import InvalidArgument

pytestmark = pytest.mark.only_backends("cma", reason="unit tests of the cma backend's region table")

BASE = 1 << 40
SIZE = 1 << 20
RW = LIVE | READ | WRITE


@pytest.fixture
def table() -> Iterator[RegionTable]:
    t = RegionTable()
    try:
        yield t
    finally:
        t.close()


@pytest.fixture
def view(table: RegionTable) -> Iterator[TableView]:
    v = TableView(table.fd)
    try:
        yield v
    finally:
        v.close()


def vendor(view: TableView, rkey: int, *, write: bool = False, addr: int = BASE, length: int = 64) -> VendorErr:
    """What an initiator's check of one range under ``rkey`` says (NONE: it may move)."""
    checked = view.check(np.array([rkey], np.uint32), np.array([addr], np.uint64), np.array([length], np.uint64), write)
    return checked.vendor


def test_a_released_slot_comes_back_under_a_new_key_and_the_old_key_stays_dead(
    backend_name: str, table: RegionTable, view: TableView
) -> None:
    old = table.publish(BASE, SIZE, RW)
    assert table.revoke(old)
    assert vendor(view, old) == VendorErr.REMOTE_REVOKED
    table.release(old)
    new = table.publish(BASE, SIZE, RW)
    assert new & (SLOTS - 1) == old & (SLOTS - 1)  # the freed slot is the one reused
    assert new != old
    assert vendor(view, new) == VendorErr.NONE
    assert vendor(view, old) == VendorErr.UNKNOWN_RKEY
    assert table.flags(old) == 0
    assert table.flags(new) == RW


def test_revoke_grant_and_release_act_on_their_own_key_only(
    backend_name: str, table: RegionTable, view: TableView
) -> None:
    key = table.publish(BASE, SIZE, LIVE)
    stale = key ^ (1 << 16)  # the same slot under another tag
    table.grant(stale, RW)
    assert table.flags(key) == LIVE  # a stale key exports nothing
    assert not table.revoke(stale)
    table.release(stale)
    assert vendor(view, key) == VendorErr.REMOTE_NO_ACCESS  # still live, still without access
    table.grant(key, LIVE | READ)
    assert vendor(view, key) == VendorErr.NONE
    assert vendor(view, key, write=True) == VendorErr.REMOTE_NO_ACCESS
    assert table.revoke(key)
    table.grant(key, RW)  # a grant racing the deregistration does not re-open the region
    assert table.flags(key) == 0
    assert vendor(view, key) == VendorErr.REMOTE_REVOKED
    # A release under a stale key after the slot was reused frees nothing of the new key's.
    table.release(key)
    newer = table.publish(BASE, SIZE, RW)
    assert newer & (SLOTS - 1) == key & (SLOTS - 1)
    table.release(key)
    assert vendor(view, newer) == VendorErr.NONE
    other = table.publish(BASE, SIZE, RW)
    assert other & (SLOTS - 1) != newer & (SLOTS - 1)  # the slot was not handed out twice


def test_the_table_holds_slots_minus_one_regions_and_refuses_the_next(backend_name: str, table: RegionTable) -> None:
    keys = [table.publish(BASE, SIZE, RW) for _ in range(SLOTS - 1)]
    assert sorted(k & (SLOTS - 1) for k in keys) == list(range(1, SLOTS))  # slot 0 is never a region's
    with pytest.raises(InvalidArgument, match=f"at most {SLOTS - 1} regions"):
        table.publish(BASE, SIZE, RW)
    table.revoke(keys[7])
    table.release(keys[7])
    again = table.publish(BASE, SIZE, RW)
    assert again & (SLOTS - 1) == keys[7] & (SLOTS - 1)


@pytest.mark.parametrize("draw", ["lowest", "highest"])
def test_a_key_s_tag_is_16_bits_and_never_0(
    backend_name: str, table: RegionTable, view: TableView, monkeypatch: pytest.MonkeyPatch, draw: str
) -> None:
    # The random draw at either end of its range: the tag spans 1..0xFFFF, so a key fits 32 bits and
    # differs from slot 0's empty key.
    monkeypatch.setattr(secrets, "randbelow", (lambda n: 0) if draw == "lowest" else (lambda n: n - 1))
    key = table.publish(BASE, SIZE, RW)
    assert key >> 16 == (1 if draw == "lowest" else 0xFFFF)
    assert vendor(view, key) == VendorErr.NONE


def test_after_shut_every_check_fails_as_from_a_closed_peer(
    backend_name: str, table: RegionTable, view: TableView
) -> None:
    key = table.publish(BASE, SIZE, RW)
    table.shut()
    assert vendor(view, key) == VendorErr.PEER_CLOSED
    assert int(view.records["flags"][0]) & CLOSED


def test_a_view_maps_only_a_table_sealed_against_writes_of_the_table_s_size(backend_name: str) -> None:
    nbytes = SLOTS * RECORD.itemsize
    # Writable by a peer (sealed against resizing only), or of another size (sealed against everything).
    for size, seal in ((nbytes, seal_fd), (nbytes - 4096, seal_fully)):
        fd = os.memfd_create("not-a-table", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            seal(fd)
            with pytest.raises(ValueError, match="not a sealed region table"):
                TableView(fd)
        finally:
            os.close(fd)


def seal_fully(fd: int) -> None:
    seal_fd(fd)
    seal_writes(fd)
