"""``TransferError`` built at a deadline: one stand-in for the timed-out transfers in the group's own
tuple, individual ``TransferTimeout`` members wherever Python code looks, and ``except*`` that splits
and re-raises as it does for a group built member by member."""

from __future__ import annotations

import gc
import pickle
import weakref
from typing import NamedTuple

import pytest

from moriio_async import TransferError, TransferFailed, TransferTimeout


class Pending(NamedTuple):
    id: int
    peer: str


def lazy() -> TransferError:
    return TransferError.after_deadline(
        [TransferFailed("REM_ACCESS_ERR", transfer_id=1)], [Pending(2, "b"), Pending(3, "c")], 0.5, 5
    )


def eager() -> TransferError:
    timed_out = [TransferTimeout(2, 0.5, peer="b"), TransferTimeout(3, 0.5, peer="c")]
    return TransferError.build([TransferFailed("REM_ACCESS_ERR", transfer_id=1)], timed_out, 5)


def ids(err: BaseException | None) -> list[int]:
    assert isinstance(err, TransferError)
    return [e.transfer_id for e in err.exceptions]


def test_reads_like_a_group_built_member_by_member() -> None:
    err, ref = lazy(), eager()
    assert str(err) == str(ref)
    assert ids(err) == ids(ref) == [1, 2, 3]
    assert [e.transfer_id for e in err.failed] == [1]
    assert [(e.transfer_id, e.timeout, e.peer) for e in err.timed_out] == [(2, 0.5, "b"), (3, 0.5, "c")]
    assert all(type(e) is TransferTimeout for e in err.timed_out)
    assert err.total == 5 and isinstance(err, ExceptionGroup)
    # Made once: every read gives the same member objects.
    assert all(x is y for x, y in zip(err.timed_out, err.exceptions[1:], strict=True))


@pytest.mark.parametrize("make", [lazy, eager])
def test_except_star_on_timeouts_re_raises_the_failures(make: type) -> None:
    caught: list[int] = []
    with pytest.raises(TransferError) as info:
        try:
            raise make()
        except* TransferTimeout as group:
            caught = ids(group)
    assert caught == [2, 3]
    assert ids(info.value) == [1]


@pytest.mark.parametrize("make", [lazy, eager])
def test_except_star_on_failures_re_raises_the_timeouts(make: type) -> None:
    with pytest.raises(TransferError) as info:
        try:
            raise make()
        except* TransferFailed as group:
            assert ids(group) == [1]
    assert ids(info.value) == [2, 3]
    assert [e.transfer_id for e in info.value.timed_out] == [2, 3]


@pytest.mark.parametrize("make", [lazy, eager])
def test_a_handler_that_re_raises_gives_back_the_whole_group(make: type) -> None:
    with pytest.raises(TransferError) as info:
        try:
            raise make()
        except* TimeoutError:
            raise
    assert ids(info.value) == [1, 2, 3]


def test_a_predicate_sees_each_member() -> None:
    match, rest = lazy().split(lambda e: getattr(e, "transfer_id", 0) == 3)
    assert ids(match) == [3] and ids(rest) == [1, 2]
    assert ids(lazy().subgroup(lambda e: isinstance(e, TransferTimeout))) == [2, 3]


def test_pickles_with_its_members() -> None:
    err = pickle.loads(pickle.dumps(lazy()))
    assert ids(err) == [1, 2, 3] and err.total == 5 and str(err) == str(eager())


def test_reading_the_members_lets_the_transfers_go() -> None:
    class Transfer:
        def __init__(self, i: int) -> None:
            self.id, self.peer = i, "b"

    ts = [Transfer(2), Transfer(3)]
    refs = [weakref.ref(t) for t in ts]
    err = TransferError.after_deadline([], ts, 1.0, 2)
    del ts
    gc.collect()
    assert all(r() is not None for r in refs), "held until the members are made"
    assert [e.transfer_id for e in err.timed_out] == [2, 3]
    gc.collect()
    assert all(r() is None for r in refs)
