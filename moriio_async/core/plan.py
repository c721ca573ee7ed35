"""Turning a batch of (local offset, remote offset, size) blocks into work requests.

Blocks are checked first, all of them, so a bad batch posts nothing. Then
blocks that are contiguous on both sides merge into one scatter entry (the
rule of vLLM's ``merge_contiguous_blocks``), and blocks that are contiguous
only on the remote side share one work request as a scatter list, up to the
device's ``max_sge``. KV-cache blocks of one layer are often contiguous on
both sides, so a batch of hundreds of blocks usually becomes a handful of
requests.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import InvalidArgument

__all__ = ["Segment", "check_blocks", "merge_contiguous_blocks", "plan_segments"]


@dataclass(frozen=True, slots=True)
class Segment:
    """One future work request: a remote range and the local pieces it maps to, in order."""

    remote_offset: int
    length: int
    pieces: tuple[tuple[int, int], ...]
    """(local offset, length) for each scatter entry."""


def _as_int_list(values: Sequence[int], what: str) -> list[int]:
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int):
            try:
                v = operator.index(v)
            except TypeError:
                raise InvalidArgument(f"{what}[{i}] is {type(v).__name__}, not an integer") from None
        out.append(int(v))
    return out


def check_blocks(
    local_offsets: Sequence[int],
    remote_offsets: Sequence[int],
    sizes: Sequence[int],
    local_length: int,
    remote_length: int,
) -> tuple[list[int], list[int], list[int]]:
    """Validate a batch against both regions' lengths; return the values as plain ints.

    Raises ``InvalidArgument`` naming the first bad block. Nothing is posted
    when this raises, which is why every block is checked before any is planned.
    """
    lo = _as_int_list(local_offsets, "local_offsets")
    ro = _as_int_list(remote_offsets, "remote_offsets")
    sz = _as_int_list(sizes, "sizes")
    if not (len(lo) == len(ro) == len(sz)):
        raise InvalidArgument(
            f"list lengths differ: {len(lo)} local offsets, {len(ro)} remote offsets, {len(sz)} sizes"
        )
    if not sz:
        raise InvalidArgument("empty batch: give at least one block")
    for i, (l_off, r_off, size) in enumerate(zip(lo, ro, sz, strict=True)):
        if size <= 0:
            raise InvalidArgument(f"block {i}: size {size} must be positive")
        if l_off < 0 or r_off < 0:
            raise InvalidArgument(f"block {i}: offsets must be >= 0 (local {l_off}, remote {r_off})")
        if l_off + size > local_length:
            raise InvalidArgument(
                f"block {i}: local range [{l_off}, {l_off + size}) exceeds the local region ({local_length} bytes)"
            )
        if r_off + size > remote_length:
            raise InvalidArgument(
                f"block {i}: remote range [{r_off}, {r_off + size}) exceeds the remote region ({remote_length} bytes)"
            )
    return lo, ro, sz


def merge_contiguous_blocks(
    local_offsets: Sequence[int], remote_offsets: Sequence[int], sizes: Sequence[int]
) -> tuple[list[int], list[int], list[int]]:
    """vLLM's rule: sort by local offset, merge neighbours contiguous on both sides."""
    order = sorted(range(len(sizes)), key=lambda i: local_offsets[i])
    out_l: list[int] = []
    out_r: list[int] = []
    out_s: list[int] = []
    for i in order:
        l_off, r_off, size = local_offsets[i], remote_offsets[i], sizes[i]
        if out_s and out_l[-1] + out_s[-1] == l_off and out_r[-1] + out_s[-1] == r_off:
            out_s[-1] += size
        else:
            out_l.append(l_off)
            out_r.append(r_off)
            out_s.append(size)
    return out_l, out_r, out_s


def plan_segments(
    local_offsets: Sequence[int],
    remote_offsets: Sequence[int],
    sizes: Sequence[int],
    *,
    max_sge: int,
    max_wr_bytes: int,
) -> list[Segment]:
    """Group checked blocks into as few work requests as the limits allow.

    Blocks are taken in remote order; a block that continues the current
    request's remote range joins it (extending its last piece when the local
    side is contiguous too, else as a new scatter entry while fewer than
    ``max_sge``), unless the request would pass ``max_wr_bytes``.
    """
    if max_sge < 1 or max_wr_bytes < 1:
        raise InvalidArgument("max_sge and max_wr_bytes must be positive")
    order = sorted(range(len(sizes)), key=lambda i: (remote_offsets[i], local_offsets[i]))
    segments: list[Segment] = []
    cur_remote = cur_len = 0
    pieces: list[list[int]] = []

    def flush() -> None:
        if pieces:
            segments.append(Segment(cur_remote, cur_len, tuple((p[0], p[1]) for p in pieces)))

    for i in order:
        l_off, r_off, size = local_offsets[i], remote_offsets[i], sizes[i]
        while size > 0:
            joins = bool(pieces) and r_off == cur_remote + cur_len and cur_len < max_wr_bytes
            if joins and pieces[-1][0] + pieces[-1][1] == l_off:
                take = min(size, max_wr_bytes - cur_len)
                pieces[-1][1] += take
            elif joins and len(pieces) < max_sge:
                take = min(size, max_wr_bytes - cur_len)
                pieces.append([l_off, take])
            else:
                flush()
                take = min(size, max_wr_bytes)
                cur_remote, cur_len, pieces = r_off, 0, [[l_off, take]]
            cur_len += take
            l_off += take
            r_off += take
            size -= take
    flush()
    return segments
