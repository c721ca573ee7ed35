"""Scattered layouts: every block of a batch lands at its own remote (or local) offset, on real engines."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from moriio_async import waiting_for_transfer_complete

from .conftest import backends, slow_examples
from .model import engine_pair

SPAN = 1 << 14
"""Bytes of each side a layout may use (the registered buffers are larger)."""


@dataclass(frozen=True, slots=True)
class Layout:
    local: list[int]
    remote: list[int]
    sizes: list[int]


@st.composite
def layouts(draw: st.DrawFn) -> Layout:
    """Blocks that overlap on neither side, placed in two independent orders with random gaps: runs
    contiguous on both sides, on one side only (a scatter list), or on neither; every block has its own
    offsets, and the two sides' offsets differ."""
    sizes = draw(st.lists(st.integers(1, 300), min_size=1, max_size=12))
    n = len(sizes)
    gap = st.sampled_from([0, 0, 0, 1, 7, 64, 513])

    def place(order: list[int]) -> list[int]:
        offsets = [0] * n
        at = draw(st.integers(0, 512))
        for i in order:
            at += draw(gap)
            offsets[i] = at
            at += sizes[i]
        return offsets

    local = place(draw(st.permutations(range(n))))
    remote = place(draw(st.permutations(range(n))))
    return Layout(local, remote, sizes)


@settings(max_examples=slow_examples(25))
@given(
    layouts(),
    st.booleans(),
    st.integers(1, 4),
    st.sampled_from([1 << 20, 256, 97]),
)
@backends()
async def test_scattered_blocks_land_at_their_own_offsets(
    backend: str, layout: Layout, write: bool, max_sge: int, max_wr_bytes: int
) -> None:
    """For any batch of non-overlapping blocks, scattered on either side or both (whatever scatter
    lists, merges and splits the runtime makes of them under max_sge and max_wr_bytes), a batch_write
    puts each block's local bytes at its remote offset and a batch_read puts each block's remote bytes
    at its local offset, and no other byte of the destination changes."""
    async with engine_pair(backend, max_sge=max_sge, max_wr_bytes=max_wr_bytes) as p:
        p.buf_a[:] = np.random.default_rng(11).integers(0, 256, p.buf_a.size, dtype=np.uint8)
        src, dst = (p.buf_a, p.buf_b) if write else (p.buf_b, p.buf_a)
        src_offsets, dst_offsets = (layout.local, layout.remote) if write else (layout.remote, layout.local)
        expected = dst.copy()
        for s, d, n in zip(src_offsets, dst_offsets, layout.sizes, strict=True):
            expected[d : d + n] = src[s : s + n]
        before_src = src.copy()
        batch = p.session.batch_write if write else p.session.batch_read
        t = batch(layout.local, layout.remote, layout.sizes)
        await waiting_for_transfer_complete([t], timeout=30)
        assert np.array_equal(src, before_src), "the source changed"
        wrong = np.flatnonzero(dst[:SPAN] != expected[:SPAN])
        assert wrong.size == 0, f"{wrong.size} destination bytes differ, first at offset {wrong[0]}"
        assert np.array_equal(dst[SPAN:], expected[SPAN:])
