from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moriio_async.core.plan import Segment, check_blocks, merge_contiguous_blocks, plan_segments
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
