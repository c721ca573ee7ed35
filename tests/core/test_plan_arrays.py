"""The array planner against a plain-Python oracle: the greedy loop the runtime used before, kept here
as the reference. Same requests, same pieces, same order, for every batch and every limit."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from moriio_async.core.plan import Plan, Segment, check_arrays, merge_contiguous_blocks, plan
from moriio_async.errors import InvalidArgument


def oracle(lo: Sequence[int], ro: Sequence[int], sz: Sequence[int], max_sge: int, max_wr: int) -> list[Segment]:
    order = sorted(range(len(sz)), key=lambda i: (ro[i], lo[i]))
    segments: list[Segment] = []
    cur_remote = cur_len = 0
    pieces: list[list[int]] = []
    for i in order:
        l_off, r_off, size = lo[i], ro[i], sz[i]
        while size > 0:
            joins = bool(pieces) and r_off == cur_remote + cur_len and cur_len < max_wr
            if joins and pieces[-1][0] + pieces[-1][1] == l_off:
                take = min(size, max_wr - cur_len)
                pieces[-1][1] += take
            elif joins and len(pieces) < max_sge:
                take = min(size, max_wr - cur_len)
                pieces.append([l_off, take])
            else:
                if pieces:
                    segments.append(Segment(cur_remote, cur_len, tuple((p[0], p[1]) for p in pieces)))
                take = min(size, max_wr)
                cur_remote, cur_len, pieces = r_off, 0, [[l_off, take]]
            cur_len += take
            l_off += take
            r_off += take
            size -= take
    if pieces:
        segments.append(Segment(cur_remote, cur_len, tuple((p[0], p[1]) for p in pieces)))
    return segments


def merge_oracle(lo: Sequence[int], ro: Sequence[int], sz: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    order = sorted(range(len(sz)), key=lambda i: lo[i])
    out_l: list[int] = []
    out_r: list[int] = []
    out_s: list[int] = []
    for i in order:
        if out_s and out_l[-1] + out_s[-1] == lo[i] and out_r[-1] + out_s[-1] == ro[i]:
            out_s[-1] += sz[i]
        else:
            out_l.append(lo[i])
            out_r.append(ro[i])
            out_s.append(sz[i])
    return out_l, out_r, out_s


# Offsets on a coarse grid make contiguity (both sides, one side, none) and overlaps all common.
block = st.tuples(st.integers(0, 40).map(lambda x: x * 4), st.integers(0, 40).map(lambda x: x * 4), st.integers(1, 3))
blocks = st.lists(block.map(lambda b: (b[0], b[1], b[2] * 4)), min_size=1, max_size=60)


@given(blocks, st.integers(1, 5), st.sampled_from([1, 3, 4, 8, 12, 16, 64, 1 << 30]))
def test_array_plan_equals_the_greedy_oracle(bl: list[tuple[int, int, int]], max_sge: int, max_wr: int) -> None:
    lo, ro, sz = ([b[i] for b in bl] for i in range(3))
    arrays = (np.asarray(v, dtype=np.int64) for v in (lo, ro, sz))
    got = plan(*arrays, max_sge=max_sge, max_wr_bytes=max_wr).segments()
    assert got == oracle(lo, ro, sz, max_sge, max_wr)


@given(blocks)
def test_merge_equals_vllm_rule(bl: list[tuple[int, int, int]]) -> None:
    lo, ro, sz = ([b[i] for b in bl] for i in range(3))
    got = merge_contiguous_blocks(lo, ro, sz)
    want = merge_oracle(lo, ro, sz)
    # vLLM sorts by local offset; blocks with equal local offsets may come in either stable order.
    assert sorted(zip(*got, strict=True)) == sorted(zip(*want, strict=True))
    assert got[0] == sorted(got[0])


def test_thousand_scattered_blocks_stay_arrays_and_group_by_max_sge() -> None:
    n = 1024
    lo = np.arange(n, dtype=np.int64)[::-1] * 8192  # local scattered (gaps), remote contiguous
    ro = np.arange(n, dtype=np.int64) * 4096
    sz = np.full(n, 4096, dtype=np.int64)
    p = plan(lo, ro, sz, max_sge=16, max_wr_bytes=64 << 20)
    assert len(p) == n // 16
    assert p.length.tolist() == [16 * 4096] * (n // 16)
    assert p.sge_offset[:2].tolist() == [(n - 1) * 8192, (n - 2) * 8192]


def test_check_arrays_names_the_first_bad_block_of_any_kind() -> None:
    with pytest.raises(InvalidArgument, match=r"block 2: remote range \[60, 68\)"):
        check_arrays([0, 0, 0, 0], [0, 8, 60, 0], [8, 8, 8, -1], 64, 64)
    with pytest.raises(InvalidArgument, match="block 1: size 0"):
        check_arrays([0, 0, 70], [0, 0, 0], [8, 0, 8], 64, 64)
    with pytest.raises(InvalidArgument, match=r"sizes\[1\] is str"):
        check_arrays([0, 0], [0, 0], [8, "8"], 64, 64)  # type: ignore[list-item]
    with pytest.raises(InvalidArgument, match="local range"):
        check_arrays([1 << 70], [0], [8], 64, 64)


def assert_well_formed(p: Plan) -> None:
    """The shape every consumer of a plan relies on: five 1-D int64 arrays, ``sge_start`` one longer than
    the requests, from 0 to the number of pieces, every request at least one piece, lengths summed."""
    arrays = (p.remote_offset, p.length, p.sge_start, p.sge_offset, p.sge_length)
    assert all(a.dtype == np.int64 and a.ndim == 1 for a in arrays)
    n, m = len(p), len(p.sge_offset)
    assert len(p.length) == n and len(p.sge_length) == m and len(p.sge_start) == n + 1
    starts = p.sge_start.tolist()
    assert starts[0] == 0 and starts[-1] == m
    assert all(a < b for a, b in itertools.pairwise(starts))
    lens = p.sge_length.tolist()
    assert p.length.tolist() == [sum(lens[a:b]) for a, b in itertools.pairwise(starts)]


@given(blocks, st.integers(1, 5), st.sampled_from([1, 3, 4, 8, 12, 16, 64, 1 << 30]))
def test_every_plan_is_well_formed_and_its_own(bl: list[tuple[int, int, int]], max_sge: int, max_wr: int) -> None:
    lo, ro, sz = (np.asarray([b[i] for b in bl], dtype=np.int64) for i in range(3))
    p = plan(lo, ro, sz, max_sge=max_sge, max_wr_bytes=max_wr)
    assert_well_formed(p)
    before = p.segments()
    lo[:], ro[:], sz[:] = 0, 0, 1  # the caller reuses its arrays: the plan is its own
    assert p.segments() == before


def test_a_single_block_plan_is_well_formed_and_its_own() -> None:
    """The single block (no sort, no masks) at, below and above max_wr_bytes; its plan owns its arrays, so
    reusing the caller's arrays for the next batch cannot change it."""
    for size, requests in ((7, 1), (8, 1), (9, 2), (24, 3)):
        lo, ro, sz = np.array([16]), np.array([32]), np.array([size])
        p = plan(lo, ro, sz, max_sge=2, max_wr_bytes=8)
        assert_well_formed(p)
        assert len(p) == requests
        assert p.segments() == oracle([16], [32], [size], 2, 8)
        lo[0], ro[0], sz[0] = 0, 0, 1
        assert p.segments() == oracle([16], [32], [size], 2, 8)
