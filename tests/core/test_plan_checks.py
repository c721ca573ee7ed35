"""The block checks on their own: ``check_block`` (the single read/write) agrees with ``check_arrays``
(batches) on every block, and both say exactly what is wrong; and how ``check_arrays`` reads its inputs
(an int64 array is checked where it lies, values int64 holds are kept exactly, odd lists get
``InvalidArgument`` naming the first bad value; blocks that touch a region's end or are one byte long are
valid)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from moriio_async.core.plan import check_arrays, check_block, merge_contiguous_blocks
from moriio_async.errors import InvalidArgument

INT64_MAX = (1 << 63) - 1


def outcome(fn: object, *args: object) -> tuple[int, ...] | str:
    assert callable(fn)
    try:
        result = fn(*args)
    except InvalidArgument as exc:
        return str(exc)
    return tuple(int(x[0]) if isinstance(x, np.ndarray) else x for x in result)


@given(
    lo=st.integers(-3, 70),
    ro=st.integers(-3, 140),
    sz=st.integers(-2, 70),
    numpy_ints=st.booleans(),
)
def test_check_block_agrees_with_check_arrays(lo: int, ro: int, sz: int, numpy_ints: bool) -> None:
    args: tuple[Any, ...] = (np.int64(lo), np.int32(ro), np.int16(sz)) if numpy_ints else (lo, ro, sz)
    single = outcome(check_block, args[0], args[1], args[2], 64, 128)
    assert single == outcome(check_arrays, [lo], [ro], [sz], 64, 128)
    ok = sz > 0 and lo >= 0 and ro >= 0 and lo + sz <= 64 and ro + sz <= 128
    assert (single == (lo, ro, sz)) is ok
    if numpy_ints and ok:
        assert all(type(v) is int for v in check_block(args[0], args[1], args[2], 64, 128))


def test_each_kind_of_bad_block_is_named_exactly() -> None:
    cases: list[tuple[tuple[Any, ...], str]] = [
        ((0, 0, 0), "block 0: size 0 must be positive"),
        ((-1, -1, -5), "block 0: size -5 must be positive"),  # size first, whatever else is wrong
        ((-1, 0, 1), "block 0: offsets must be >= 0 (local -1, remote 0)"),
        ((0, -2, 1), "block 0: offsets must be >= 0 (local 0, remote -2)"),
        ((60, 200, 8), "block 0: local range [60, 68) exceeds the local region (64 bytes)"),  # local before remote
        ((0, 125, 4), "block 0: remote range [125, 129) exceeds the remote region (128 bytes)"),
        ((56, 125, 8), "block 0: remote range [125, 133) exceeds the remote region (128 bytes)"),  # local ends at 64
    ]
    for (lo, ro, sz), message in cases:
        variants: tuple[tuple[Any, ...], ...] = ((lo, ro, sz), (np.int64(lo), ro, sz))
        for args in variants:
            with pytest.raises(InvalidArgument) as info:
                check_block(args[0], args[1], args[2], 64, 128)
            assert str(info.value) == message
        with pytest.raises(InvalidArgument) as info:
            check_arrays([lo], [ro], [sz], 64, 128)
        assert str(info.value) == message
    assert check_block(56, 120, 8, 64, 128) == (56, 120, 8)  # both ranges end exactly at their region's end
    assert check_block(np.uint8(56), 120, np.int64(8), 64, 128) == (56, 120, 8)  # type: ignore[arg-type]


def test_a_value_that_is_no_integer_is_named_with_its_type() -> None:
    singles: tuple[tuple[tuple[Any, ...], str], ...] = (
        ((0.0, 0, 1), "local_offset is float, not an integer"),
        ((0, "0", 1), "remote_offset is str, not an integer"),
        ((0, 0, None), "size is NoneType, not an integer"),
        ((0, 0, np.float64(1)), "size is float64, not an integer"),
    )
    for args, message in singles:
        with pytest.raises(InvalidArgument) as info:
            check_block(args[0], args[1], args[2], 64, 128)
        assert str(info.value) == message
    batches: tuple[tuple[tuple[Any, ...], str], ...] = (
        (([0.5], [0], [1]), "local_offsets[0] is float, not an integer"),
        (([0, 1], [0, 1.0], [1, 1]), "remote_offsets[1] is float, not an integer"),
        (([0], [0], ["1"]), "sizes[0] is str, not an integer"),
        ((np.zeros((1, 1), dtype=np.int64), [0], [1]), "local_offsets[0] is list, not an integer"),
        ((np.array([0.0]), [0], [1]), "local_offsets[0] is float, not an integer"),
    )
    for lists, message in batches:
        with pytest.raises(InvalidArgument) as info:
            check_arrays(lists[0], lists[1], lists[2], 64, 128)
        assert str(info.value) == message


def test_batch_shape_errors_are_exact() -> None:
    with pytest.raises(InvalidArgument) as info:
        check_arrays([0, 1], [0], [1, 1, 1], 64, 64)
    assert str(info.value) == "list lengths differ: 2 local offsets, 1 remote offsets, 3 sizes"
    empties: tuple[Any, ...] = ([], np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint64))
    for empty in empties:
        with pytest.raises(InvalidArgument) as info:
            check_arrays(empty, empty, empty, 64, 64)
        assert str(info.value) == "empty batch: give at least one block"


def test_integer_arrays_of_any_width_and_ints_past_int64_are_read_as_int64() -> None:
    for dtype in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint32, np.uint64):
        lo, ro, sz = check_arrays(np.array([0, 8], dtype=dtype), [0, 8], (8, 8), 64, 64)
        assert lo.dtype == ro.dtype == sz.dtype == np.int64
        assert (lo.tolist(), ro.tolist(), sz.tolist()) == ([0, 8], [0, 8], [8, 8])
    lo, _, _ = check_arrays(np.array([INT64_MAX - 8], dtype=np.uint64), [0], [8], INT64_MAX, 64)
    assert lo.tolist() == [INT64_MAX - 8]  # the largest uint64 an int64 holds: kept
    # Past int64 (uint64 or a Python int): clamped to +-INT64_MAX, which exceeds any region.
    pasts: tuple[Any, ...] = (np.array([1 << 63], dtype=np.uint64), [1 << 70])
    for past in pasts:
        with pytest.raises(InvalidArgument) as info:
            check_arrays(past, [0], [8], 64, 64)
        assert str(info.value) == (
            f"block 0: local range [{INT64_MAX}, {INT64_MAX + 8}) exceeds the local region (64 bytes)"
        )
    with pytest.raises(InvalidArgument) as info:
        check_arrays([0], [-(1 << 70)], [8], 64, 64)
    assert str(info.value) == f"block 0: offsets must be >= 0 (local 0, remote {-INT64_MAX})"
    with pytest.raises(InvalidArgument) as info:
        check_arrays([0, 1 << 70], [0, 0], [8, 8], 64, 64)  # a big int after a good block
    assert str(info.value).startswith("block 1: local range")


def test_merge_keeps_the_input_order_of_blocks_with_the_same_local_offset() -> None:
    """vLLM sorts with Python's (stable) sort: equal local offsets stay in input order. numpy's default
    sort is not stable past 16 elements."""
    lo = [(i * 7) % 5 for i in range(200)]
    ro = [i * 1000 for i in range(200)]  # never contiguous: nothing merges
    out_lo, out_ro, out_sz = merge_contiguous_blocks(lo, ro, [1] * 200)
    assert out_lo == sorted(lo)
    assert out_ro == [r for _, r in sorted(zip(lo, ro, strict=True), key=lambda b: b[0])]
    assert out_sz == [1] * 200


def test_merge_sums_sizes_in_int64_whatever_the_input_width() -> None:
    sizes = np.full(3, 1 << 30, dtype=np.int32)
    offsets = [0, 1 << 30, 2 << 30]
    assert merge_contiguous_blocks(offsets, offsets, sizes) == ([0], [0], [3 << 30])  # type: ignore[arg-type]
    assert merge_contiguous_blocks([], [], []) == ([], [], [])


def test_merge_reads_narrow_integer_arrays_as_int64() -> None:
    """In uint8, remote 200 + size 100 wraps to 44: the two blocks below would look contiguous on
    both sides and merge. Read as int64 they are not contiguous remotely, so nothing merges."""
    u8 = np.uint8
    got = merge_contiguous_blocks(
        np.array([0, 100], dtype=u8),  # type: ignore[arg-type]
        np.array([200, 44], dtype=u8),  # type: ignore[arg-type]
        np.array([100, 10], dtype=u8),  # type: ignore[arg-type]
    )
    assert got == ([0, 100], [200, 44], [100, 10])


def test_merge_checks_each_block_against_the_size_of_the_one_before() -> None:
    # Three blocks of different sizes contiguous on both sides: one block.
    assert merge_contiguous_blocks([0, 4, 12], [100, 104, 112], [4, 8, 4]) == ([0], [100], [16])
    # The third is local-contiguous with the second (4 + 8) but remote-contiguous only with the first's size.
    assert merge_contiguous_blocks([0, 4, 12], [100, 104, 108], [4, 8, 4]) == ([0, 12], [100, 108], [12, 4])


# -- how check_arrays reads its inputs -------------------------------------------------------------------


INT64_MIN = -(1 << 63)


def message(*args: Any) -> str:
    with pytest.raises(InvalidArgument) as info:
        check_arrays(*args)
    return str(info.value)


def test_an_int64_array_is_checked_in_place_not_copied() -> None:
    """The engine's usual batch is already int64: checking it costs no copy of the caller's arrays."""
    lo = np.array([0, 8, 16], dtype=np.int64)
    ro = np.array([64, 0, 32], dtype=np.int64)
    sz = np.array([8, 8, 8], dtype=np.int64)
    got = check_arrays(lo, ro, sz, 64, 128)
    for array, checked in zip((lo, ro, sz), got, strict=True):
        assert checked.dtype == np.int64
        assert np.shares_memory(array, checked)
    # Any other width is converted, into an int64 array of its own.
    narrow = np.array([0, 8, 16], dtype=np.int32)
    converted = check_arrays(narrow, ro, sz, 64, 128)[0]
    assert converted.dtype == np.int64 and not np.shares_memory(narrow, converted)
    assert converted.tolist() == [0, 8, 16]


def test_the_smallest_int64_is_reported_as_given() -> None:
    """-2**63 fits int64, so a list holding it is read as it is (the clamp to -(2**63 - 1) is for values
    past int64 only), and the message names the offset the caller gave."""
    assert message([INT64_MIN], [0], [8], 64, 64) == f"block 0: offsets must be >= 0 (local {INT64_MIN}, remote 0)"
    assert message([0, 0], [0, INT64_MIN], [8, 8], 64, 64) == (
        f"block 1: offsets must be >= 0 (local 0, remote {INT64_MIN})"
    )


def test_a_ragged_list_is_an_invalid_argument() -> None:
    """numpy refuses to make an array of [[0, 1], [2]]; the check still names the bad value."""
    assert message([[0, 1], [2]], [0, 0], [1, 1], 64, 64) == "local_offsets[0] is list, not an integer"
    assert message([0, 8], [0, [8, 9, 10]], [8, 8], 64, 64) == "remote_offsets[1] is list, not an integer"


def test_numpy_integers_before_a_bad_value_are_read_as_integers() -> None:
    """A list that is not all integers is read value by value: numpy integers in it are integers, and
    the first value that is not one is named."""
    assert message([np.int32(8), "x"], [0, 0], [8, 8], 64, 64) == "local_offsets[1] is str, not an integer"
    assert message([0, 0], [0, 0], [np.uint8(8), 8.0], 64, 64) == "sizes[1] is float, not an integer"
    assert message([np.int64(8), 1 << 70], [0, 0], [8, 8], 64, 64).startswith("block 1: local range")


def test_blocks_of_one_byte_and_blocks_that_end_at_a_region_end_are_valid() -> None:
    lo, ro, sz = check_arrays([0, 63], [127, 0], [1, 1], 64, 128)
    assert (lo.tolist(), ro.tolist(), sz.tolist()) == ([0, 63], [127, 0], [1, 1])
    lo, ro, sz = check_arrays([56, 0], [120, 0], [8, 64], 64, 128)  # both regions' last bytes; all of local
    assert (lo.tolist(), ro.tolist(), sz.tolist()) == ([56, 0], [120, 0], [8, 64])
    assert check_block(63, 127, 1, 64, 128) == (63, 127, 1)
    assert check_block(0, 0, 1, 64, 128) == (0, 0, 1)
    assert check_block(0, 0, 64, 64, 128) == (0, 0, 64)
    assert check_block(0, 64, 64, 64, 128) == (0, 64, 64)
    # The same edges with numpy integers, which check_block reads value by value.
    assert check_block(np.int64(0), np.int32(0), np.int16(1), 64, 128) == (0, 0, 1)  # type: ignore[arg-type]
    assert check_block(np.int64(63), np.int64(127), np.uint8(1), 64, 128) == (63, 127, 1)  # type: ignore[arg-type]
    assert check_block(np.int64(0), np.int64(64), np.int64(64), 64, 128) == (0, 64, 64)  # type: ignore[arg-type]
    # One byte more is one byte too many, on either side.
    assert message([57], [0], [8], 64, 128) == "block 0: local range [57, 65) exceeds the local region (64 bytes)"
    assert message([0], [121], [8], 64, 128) == "block 0: remote range [121, 129) exceeds the remote region (128 bytes)"


@pytest.mark.parametrize("flag", [True, np.True_], ids=["bool", "numpy-bool"])
def test_a_bool_is_not_an_offset_or_a_size(flag: Any) -> None:
    """``operator.index(True)`` is 1, so a flag passed by mistake would move the byte at offset 1."""
    with pytest.raises(InvalidArgument, match=r"^local_offset is bool, not an integer$"):
        check_block(flag, 0, 8, 64, 64)
    with pytest.raises(InvalidArgument, match=r"^size is bool, not an integer$"):
        check_block(0, 0, flag, 64, 64)
    with pytest.raises(InvalidArgument, match=r"^local_offsets\[0\] is bool, not an integer$"):
        check_arrays([flag], [0], [8], 64, 64)
    with pytest.raises(InvalidArgument, match=r"^sizes\[0\] is bool, not an integer$"):
        check_arrays(np.array([0, 8]), np.array([0, 8]), np.array([True, True]), 64, 64)  # a bool array
