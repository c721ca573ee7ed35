"""How ``check_arrays`` reads its inputs: an int64 array is checked where it lies, values int64 holds are
kept exactly (only values past int64 are clamped), and odd lists (nested, ragged, numpy scalars beside
a bad value) get ``InvalidArgument`` naming the first bad value; blocks that touch a region's end or are
one byte long are valid."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from moriio_async.core.plan import check_arrays, check_block
from moriio_async.errors import InvalidArgument

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
    for given, checked in zip((lo, ro, sz), got, strict=True):
        assert checked.dtype == np.int64
        assert np.shares_memory(given, checked)
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
