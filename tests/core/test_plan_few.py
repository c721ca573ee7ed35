"""``check_few``/``plan_few`` (batches of up to ``SMALL`` blocks of plain ints) against ``check_arrays``/``plan``:
for any batch, over sizes that cross ``SMALL``, the same values, the same errors and the same requests;
anything that is not a few plain ints is left to the array path (None)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moriio_async.core.plan import SMALL, check_arrays, check_few, plan, plan_few
from moriio_async.errors import InvalidArgument

LOCAL, REMOTE = 4096, 8192
ints = st.integers(-64, 9000) | st.sampled_from([0, 1, 4096, 8192, (1 << 63) - 1, -(1 << 63), 1 << 63, 1 << 70])


def outcome(fn: object, *args: object) -> object:
    try:
        got = fn(*args)  # type: ignore[operator]
    except InvalidArgument as exc:
        return ("raises", str(exc))
    return got


@settings(max_examples=400, deadline=None)
@given(st.integers(1, SMALL + 2).flatmap(lambda n: st.tuples(*[st.lists(ints, min_size=n, max_size=n)] * 3)))
def test_check_few_agrees_with_check_arrays(batch: tuple[list[int], list[int], list[int]]) -> None:
    lo, ro, sz = batch
    few = outcome(check_few, lo, ro, sz, LOCAL, REMOTE)
    arrays = outcome(check_arrays, lo, ro, sz, LOCAL, REMOTE)
    if len(lo) > SMALL or any(not -(1 << 63) <= v < 1 << 63 for v in lo + ro + sz):
        assert few is None  # more than a few, or not what int64 holds: the array path decides
        return
    if isinstance(arrays, tuple) and isinstance(arrays[0], str):  # check_arrays raised
        assert few == arrays
    else:
        assert few == tuple(a.tolist() for a in arrays)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("lo", "ro", "sz"),
    [
        ([0, 8], [0], [8, 8]),  # lengths differ
        ([], [], []),  # empty
        ([True], [0], [8]),  # a bool is not an offset
        ([np.int64(0)], [0], [8]),  # a numpy integer in a list
        ([0.0], [0], [8]),
        (np.array([0], np.uint64), [0], [8]),  # unsigned arrays
        (np.zeros((1, 1), np.int64), [0], [8]),
        (iter([0]), [0], [8]),
        (list(range(SMALL + 1)), list(range(SMALL + 1)), [1] * (SMALL + 1)),
    ],
)
def test_anything_but_a_few_plain_ints_is_left_to_the_array_path(lo: object, ro: object, sz: object) -> None:
    assert check_few(lo, ro, sz, LOCAL, REMOTE) is None


def test_a_signed_array_of_a_few_is_read_as_ints() -> None:
    got = check_few(np.array([0, 8], np.int32), (16, 0), [8, 8], LOCAL, REMOTE)
    assert got == ([0, 8], [16, 0], [8, 8]) and all(type(v) is int for v in got[0])


def blocks(max_n: int) -> st.SearchStrategy[tuple[list[int], list[int], list[int]]]:
    """Valid blocks on a grid of 64-byte slots, so runs contiguous on one side, both or neither all come up."""
    block = st.tuples(st.integers(0, 30), st.integers(0, 60), st.integers(1, 3))
    return st.lists(block, min_size=1, max_size=max_n).map(
        lambda bs: ([64 * a for a, _, _ in bs], [64 * b for _, b, _ in bs], [64 * n for _, _, n in bs])
    )


@settings(max_examples=400, deadline=None)
@given(blocks(SMALL), st.integers(1, 4), st.sampled_from([64, 100, 128, 192, 1000, 1 << 20]))
def test_plan_few_makes_the_requests_plan_makes(
    batch: tuple[list[int], list[int], list[int]], max_sge: int, max_wr_bytes: int
) -> None:
    lo, ro, sz = batch
    arrays = plan(*(np.asarray(v, dtype=np.int64) for v in batch), max_sge=max_sge, max_wr_bytes=max_wr_bytes)
    few = plan_few(lo, ro, sz, max_sge=max_sge, max_wr_bytes=max_wr_bytes)
    columns = (arrays.remote_offset, arrays.length, arrays.sge_start, arrays.sge_offset, arrays.sge_length)
    assert few == tuple(c.tolist() for c in columns)


def test_plan_few_refuses_the_limits_plan_refuses() -> None:
    with pytest.raises(InvalidArgument, match="must be positive"):
        plan_few([0], [0], [8], max_sge=0, max_wr_bytes=8)
