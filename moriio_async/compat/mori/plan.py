"""How one MoRI-style batch becomes posts on several queue pairs (pure functions, no I/O).

MoRI-IO's order, kept here: blocks are checked (any failure refuses the whole
batch, with MoRI-IO's messages), sorted by remote offset, and neighbours that
are contiguous on both sides merge into one request. The merged requests are
cut into post batches of ``post_batch_size`` (-1: as many as make one batch
per queue pair); post batch ``i`` goes to queue pair ``(i + uid) % n``, so
single-request transfers spread over the pairs.

Size-0 blocks are checked like the others (``offset <= region size``) and
then dropped: MoRI-IO posts them as zero-length requests, which move nothing.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import SupportsIndex

__all__ = ["MAX_REQUEST", "Part", "check_blocks", "plan_parts"]

MAX_REQUEST = (1 << 32) - 1
"""MoRI-IO refuses a single block above UINT32_MAX bytes."""


@dataclass(frozen=True, slots=True)
class Part:
    """One post: merged requests for one queue pair (a stripe) of a session."""

    stripe: int
    local_offsets: list[int]
    remote_offsets: list[int]
    sizes: list[int]


def check_blocks(
    local_offsets: Sequence[int],
    remote_offsets: Sequence[int],
    sizes: Sequence[int],
    local_size: int,
    remote_size: int,
) -> tuple[list[int], list[int], list[int]] | str:
    """The blocks as int lists, or MoRI-IO's message saying why the batch is refused."""
    try:
        lo = [_size_t(v) for v in local_offsets]
        ro = [_size_t(v) for v in remote_offsets]
        sz = [_size_t(v) for v in sizes]
    except (TypeError, ValueError) as exc:
        return f"invalid block: {exc}"
    if not len(lo) == len(ro) == len(sz):
        return "lengths of local offsets, remote offsets or sizes mismatch"
    for i, n in enumerate(sz):
        if n > MAX_REQUEST:
            return f"single request size {n} exceeds UINT32_MAX; split it before submitting"
        if lo[i] + n > local_size or ro[i] + n > remote_size:
            return "length out of range"
    return lo, ro, sz


def _size_t(value: SupportsIndex) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{value!r} is not an integer")
    n = operator.index(value)  # TypeError for floats and strings
    if n < 0:
        raise ValueError(f"{n} is negative")
    return n


def plan_parts(
    local_offsets: list[int],
    remote_offsets: list[int],
    sizes: list[int],
    *,
    stripes: int,
    post_batch_size: int,
    uid: int,
) -> list[Part]:
    """Checked blocks -> posts. An empty result means nothing to move (MoRI-IO: SUCCESS at once)."""
    blocks = sorted((r, lo, n) for lo, r, n in zip(local_offsets, remote_offsets, sizes, strict=True) if n)
    merged: list[list[int]] = []  # [remote, local, size]
    for r, lo, n in blocks:
        if merged and merged[-1][0] + merged[-1][2] == r and merged[-1][1] + merged[-1][2] == lo:
            merged[-1][2] += n
        else:
            merged.append([r, lo, n])
    if not merged:
        return []
    per_post = -(-len(merged) // stripes) if post_batch_size == -1 else max(post_batch_size, 1)
    parts = []
    for i, start in enumerate(range(0, len(merged), per_post)):
        chunk = merged[start : start + per_post]
        parts.append(
            Part(
                (i + uid) % stripes,
                [c[1] for c in chunk],
                [c[0] for c in chunk],
                [c[2] for c in chunk],
            )
        )
    return parts
