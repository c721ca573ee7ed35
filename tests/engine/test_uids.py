"""Transfer uids are MoRI-IO's unsigned 64-bit ``TransferUniqueId``: anything else is refused, with a message."""

from __future__ import annotations

import re

import pytest

from moriio_async import InvalidArgument
from moriio_async.engine.uids import MAX_UID, TransferUids, check_uid


def test_a_uid_is_any_unsigned_64_bit_int() -> None:
    assert MAX_UID == 2**64 - 1
    for uid in (0, 1, 2**63, 2**64 - 1):
        assert check_uid(uid) == uid
        uids = TransferUids()
        assert uids.claim(uid) == uid
        assert uid in uids and len(uids) == 1


@pytest.mark.parametrize(
    ("uid", "message"),
    [
        (-1, "transfer uid -1 is outside 0..2**64-1"),
        (2**64, f"transfer uid {2**64} is outside 0..2**64-1"),
        (True, "transfer uid must be an int, not bool"),
        (1.0, "transfer uid must be an int, not float"),
        ("7", "transfer uid must be an int, not str"),
        (None, "transfer uid must be an int, not NoneType"),
    ],
)
def test_anything_else_is_refused_with_what_it_was(uid: object, message: str) -> None:
    with pytest.raises(InvalidArgument, match=f"^{re.escape(message)}$"):
        check_uid(uid)
    uids = TransferUids()
    with pytest.raises(InvalidArgument, match=f"^{re.escape(message)}$"):
        uids.claim(uid)
    assert len(uids) == 0  # a refused uid is not held


def test_a_uid_in_flight_is_refused_with_a_hint_and_free_again_once_released() -> None:
    uids = TransferUids()
    uids.claim(7)
    with pytest.raises(InvalidArgument, match=r"^transfer uid 7 is still in flight") as info:
        uids.claim(7)
    assert info.value.hint == "use engine.allocate_transfer_uid(), or wait for the transfer holding it to end"
    assert 7 in uids and len(uids) == 1  # the refused claim changed nothing
    uids.release(7)
    uids.release(7)  # releasing twice is harmless
    assert 7 not in uids and len(uids) == 0
    assert uids.claim(7) == 7


def test_allocate_skips_every_uid_in_flight_and_hands_out_each_once() -> None:
    uids = TransferUids()
    for held in (0, 1, 3, 4):
        uids.claim(held)
    assert [uids.allocate() for _ in range(3)] == [2, 5, 6]
    assert len(uids) == 4  # allocating does not claim
