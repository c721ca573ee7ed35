"""The planner: contiguous blocks merged (only when both sides are), the blocks checked, and requests
planned within ``max_sge`` and ``max_wr_bytes`` so every byte maps as the blocks do; and its list
form, ``plan_segments`` and ``Plan.segments`` (inputs of any integer width; a ``Plan`` whose arrays
disagree in length is refused rather than cut short)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from moriio_async.core.plan import Plan, Segment, check_blocks, merge_contiguous_blocks, plan, plan_segments
from moriio_async.errors import InvalidArgument


def test_merge_all_contiguous_gives_one_segment() -> None:
    assert merge_contiguous_blocks([0, 4, 8], [100, 104, 108], [4, 4, 4]) == ([0], [100], [12])


def test_merge_none_contiguous_gives_input_back_sorted_by_local() -> None:
    assert merge_contiguous_blocks([8, 0], [0, 50], [4, 4]) == ([0, 8], [50, 0], [4, 4])


def test_merge_needs_both_sides_contiguous() -> None:
    # local contiguous, remote not
    assert merge_contiguous_blocks([0, 4], [0, 8], [4, 4]) == ([0, 4], [0, 8], [4, 4])


def test_plan_uses_scatter_list_for_remote_contiguous_local_scattered() -> None:
    segs = plan_segments([0, 100, 200], [0, 4, 8], [4, 4, 4], max_sge=16, max_wr_bytes=1 << 20)
    assert len(segs) == 1
    assert segs[0].pieces == ((0, 4), (100, 4), (200, 4))


@pytest.mark.parametrize(
    ("lo", "ro", "expected"),
    [
        # Local contiguous all along, remote with a gap: two pieces, one request each.
        ([0, 8, 16, 24], [0, 8, 32, 40], [Segment(0, 16, ((0, 16),)), Segment(32, 16, ((16, 16),))]),
        # Both sides contiguous, then local contiguous only.
        ([0, 8, 16], [0, 8, 100], [Segment(0, 16, ((0, 16),)), Segment(100, 8, ((16, 8),))]),
        # Remote contiguous only: one request, a scatter entry per block.
        ([0, 64, 128], [0, 8, 16], [Segment(0, 24, ((0, 8), (64, 8), (128, 8)))]),
        # Remote contiguous, local contiguous the other way round: not one piece.
        ([8, 0], [0, 8], [Segment(0, 16, ((8, 8), (0, 8)))]),
        # Both sides contiguous in two runs that touch neither side of each other.
        ([0, 8, 64, 72], [0, 8, 16, 24], [Segment(0, 32, ((0, 16), (64, 16)))]),
    ],
    ids=["remote-gap", "then-local-only", "remote-only", "local-reversed", "two-runs"],
)
def test_the_vectorised_planner_merges_pieces_only_when_both_sides_are_contiguous(
    lo: list[int], ro: list[int], expected: list[Segment]
) -> None:
    assert plan_segments(lo, ro, [8] * len(lo), max_sge=16, max_wr_bytes=1 << 20) == expected


def test_merge_contiguous_blocks_needs_both_sides_at_every_boundary() -> None:
    assert merge_contiguous_blocks([0, 8, 16], [0, 8, 100], [8, 8, 8]) == ([0, 16], [0, 100], [16, 8])
    assert merge_contiguous_blocks([0, 64, 72], [0, 8, 16], [8, 8, 8]) == ([0, 64], [0, 8], [8, 16])


def test_plan_respects_max_sge_and_max_wr_bytes() -> None:
    segs = plan_segments([0, 100, 200], [0, 4, 8], [4, 4, 4], max_sge=2, max_wr_bytes=1 << 20)
    assert [len(s.pieces) for s in segs] == [2, 1]
    segs = plan_segments([0], [0], [10], max_sge=4, max_wr_bytes=4)
    assert [(s.remote_offset, s.length) for s in segs] == [(0, 4), (4, 4), (8, 2)]


@pytest.mark.parametrize(
    ("lo", "ro", "sz", "needle"),
    [
        ([0], [0], [0], "size 0 must be positive"),
        ([0], [0], [-1], "must be positive"),
        ([-1], [0], [1], "offsets must be >= 0"),
        ([0, 1], [0], [1], "list lengths differ"),
        ([], [], [], "empty batch"),
        ([60], [0], [8], "local range [60, 68) exceeds the local region (64 bytes)"),
        ([0], [125], [4], "remote range [125, 129) exceeds the remote region (128 bytes)"),
        ([0.5], [0], [1], "local_offsets[0] is float"),
    ],
)
def test_check_blocks_rejects(lo: list[int], ro: list[int], sz: list[int], needle: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        check_blocks(lo, ro, sz, 64, 128)
    assert needle in str(info.value)


def test_check_blocks_accepts_numpy_integers() -> None:
    np = pytest.importorskip("numpy")
    lo, ro, sz = check_blocks(np.array([0, 8]), [np.int64(0), 8], [8, 8], 64, 64)
    assert (lo, ro, sz) == ([0, 8], [0, 8], [8, 8])
    assert all(type(v) is int for v in lo + ro + sz)


blocks = st.lists(st.tuples(st.integers(0, 63), st.integers(0, 63), st.integers(1, 8)), min_size=1, max_size=20)


@given(blocks, st.integers(1, 4), st.integers(1, 32))
def test_plan_maps_every_byte_exactly_as_the_blocks_do(
    bl: list[tuple[int, int, int]], max_sge: int, max_wr: int
) -> None:
    """Property: planning changes how requests are cut, never which local byte goes to which remote byte."""
    # Make remote ranges disjoint so the mapping is a function.
    bl2 = []
    used: set[int] = set()
    for lo, ro, sz in bl:
        rng = set(range(ro, ro + sz))
        if rng & used:
            continue
        used |= rng
        bl2.append((lo, ro, sz))
    want = {ro + i: lo + i for lo, ro, sz in bl2 for i in range(sz)}
    segs = plan_segments(
        [b[0] for b in bl2], [b[1] for b in bl2], [b[2] for b in bl2], max_sge=max_sge, max_wr_bytes=max_wr
    )
    got: dict[int, int] = {}
    for s in segs:
        assert 1 <= len(s.pieces) <= max_sge
        assert s.length == sum(n for _, n in s.pieces) <= max_wr
        pos = s.remote_offset
        for lo, n in s.pieces:
            for i in range(n):
                got[pos + i] = lo + i
            pos += n
    assert got == want


# -- plan_segments and Plan.segments, the planner's list form: any integer width, arrays of one length ---


def i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def segments_u8(local: list[int], remote: list[int], sizes: list[int]) -> list[Segment]:
    """``plan_segments`` of uint8 arrays (the narrow dtype whose sums wrap)."""
    u8 = np.uint8
    return plan_segments(
        np.array(local, dtype=u8),  # type: ignore[arg-type]
        np.array(remote, dtype=u8),  # type: ignore[arg-type]
        np.array(sizes, dtype=u8),  # type: ignore[arg-type]
        max_sge=4,
        max_wr_bytes=1 << 20,
    )


def test_plan_segments_reads_narrow_integer_arrays_as_int64() -> None:
    """In uint8, local 200 + size 100 wraps to 44: the second block below, which continues the first on
    the remote side, would look local-contiguous too and merge into one 110-byte piece at local 200 (bytes
    from the wrong place). As int64 the blocks are two pieces of one request."""
    segs = segments_u8([200, 44], [0, 100], [100, 10])
    assert segs == [Segment(0, 110, ((200, 100), (44, 10)))]
    assert all(type(v) is int for s in segs for v in (s.remote_offset, s.length, *sum(s.pieces, ())))
    # Remote order is int64 order too: two requests, the lower remote offset first.
    segs = segments_u8([0, 10], [200, 44], [100, 10])
    assert segs == [Segment(44, 10, ((10, 10),)), Segment(200, 100, ((0, 100),))]


def test_segments_of_a_consistent_plan() -> None:
    p = Plan(i64(0, 64), i64(12, 4), i64(0, 2, 3), i64(0, 40, 8), i64(8, 4, 4))
    assert p.segments() == [Segment(0, 12, ((0, 8), (40, 4))), Segment(64, 4, ((8, 4),))]


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        # fewer scatter lengths than scatter offsets
        (Plan(i64(0), i64(8), i64(0, 2), i64(0, 4), i64(4)), "zip() argument 2 is shorter than argument 1"),
        # more remote offsets than request lengths
        (Plan(i64(0, 8), i64(8), i64(0, 1, 1), i64(0), i64(8)), "zip() argument 2 is shorter than argument 1"),
        # more request lengths than remote offsets
        (Plan(i64(0), i64(8, 8), i64(0, 1), i64(0), i64(8)), "zip() argument 2 is longer than argument 1"),
    ],
)
def test_segments_refuses_arrays_of_different_lengths(plan: Plan, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        plan.segments()
    assert str(info.value) == message


def test_a_piece_just_below_the_previous_one_locally_is_a_scatter_entry_of_its_own() -> None:
    """Remote-contiguous blocks whose local offsets step down (100, then 96 = 100 - 4) are not local-
    contiguous: each keeps its own scatter entry, also where the run is cut at max_wr_bytes."""
    lo, ro, sz = [100, 96, 500], [0, 4, 8], [4, 4, 8]
    assert plan_segments(lo, ro, sz, max_sge=4, max_wr_bytes=1 << 20) == [Segment(0, 16, ((100, 4), (96, 4), (500, 8)))]
    assert plan_segments(lo, ro, sz, max_sge=4, max_wr_bytes=12) == [
        Segment(0, 12, ((100, 4), (96, 4), (500, 4))),
        Segment(12, 4, ((504, 4),)),
    ]


@pytest.mark.parametrize(("max_sge", "max_wr_bytes"), [(0, 64), (64, 0), (0, 0), (-1, 64), (4, -8)])
def test_limits_below_one_are_refused(max_sge: int, max_wr_bytes: int) -> None:
    with pytest.raises(InvalidArgument) as info:
        plan_segments([0], [0], [8], max_sge=max_sge, max_wr_bytes=max_wr_bytes)
    assert str(info.value) == "max_sge and max_wr_bytes must be positive"


def test_limits_of_one_are_the_tightest_plan() -> None:
    """One scatter entry and one byte a request: every byte is a request of its own."""
    assert plan_segments([0, 100], [0, 2], [2, 1], max_sge=1, max_wr_bytes=1) == [
        Segment(0, 1, ((0, 1),)),
        Segment(1, 1, ((1, 1),)),
        Segment(2, 1, ((100, 1),)),
    ]
    assert plan_segments([0, 100], [0, 2], [2, 1], max_sge=1, max_wr_bytes=1 << 20) == [
        Segment(0, 2, ((0, 2),)),
        Segment(2, 1, ((100, 1),)),
    ]


def test_an_empty_batch_plans_to_no_requests() -> None:
    """check_arrays refuses an empty batch before the engine plans; planned directly, it is no requests."""
    assert plan_segments([], [], [], max_sge=4, max_wr_bytes=64) == []
    p = plan(i64(), i64(), i64(), max_sge=4, max_wr_bytes=64)
    assert len(p) == 0 and p.sge_start.tolist() == [0] and len(p.sge_offset) == 0


def test_blocks_contiguous_on_both_sides_are_one_scatter_entry() -> None:
    """A layer's KV blocks back to back on both sides, in any input order and of any sizes, are one request
    of one scatter entry, whatever max_sge (each join is checked against the block just before it)."""
    for sizes in ([4, 4, 4], [4, 8, 4], [4, 8, 4, 16, 4], [16, 4, 4, 8, 12, 4]):
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        total = sum(sizes)
        for order in (slice(None), slice(None, None, -1)):
            lo = [64 + s for s in starts][order]
            ro = [1000 + s for s in starts][order]
            got = plan_segments(lo, ro, sizes[order], max_sge=1, max_wr_bytes=1 << 20)
            assert got == [Segment(1000, total, ((64, total),))]
