"""Turning a batch of (local offset, remote offset, size) blocks into work requests, on arrays.

Blocks are checked first, all of them, so a bad batch posts nothing. Then
blocks that are contiguous on both sides merge into one scatter entry (the
rule of vLLM's ``merge_contiguous_blocks``), and blocks that are contiguous
only on the remote side share one work request as a scatter list, up to the
device's ``max_sge``. KV-cache blocks of one layer are often contiguous on
both sides, so a batch of hundreds of blocks usually becomes a handful of
requests.

Everything runs as numpy operations over the whole batch (sort, boundary
masks, ``reduceat``), so a batch of thousands of blocks costs a few
vectorised passes, not Python work per block. The one case that is not
vectorised is a remote-contiguous run longer than ``max_wr_bytes``, which
must be cut at byte positions: it runs a greedy loop over the run's merged
pieces (few, since such runs are made of large contiguous pieces).

A batch of a few blocks (at most ``SMALL``) of plain ints is checked and
planned on the ints instead (``check_few``, ``plan_few``): there numpy's cost
per call is most of the work. Same rules, same requests, same errors; the
same greedy walk does the planning.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..errors import InvalidArgument

__all__ = [
    "SMALL",
    "FewPlan",
    "Plan",
    "Segment",
    "check_arrays",
    "check_block",
    "check_blocks",
    "check_few",
    "merge_contiguous_blocks",
    "plan",
    "plan_few",
    "plan_segments",
]

I64 = npt.NDArray[np.int64]
_INT64_MAX = (1 << 63) - 1
_INT64_MIN = -(1 << 63)

SMALL = 8
"""Batches of up to this many blocks are checked and planned on plain ints (``check_few``, ``plan_few``)."""

FewPlan = tuple[list[int], list[int], list[int], list[int], list[int]]
"""``Plan``'s five columns as int lists: remote offset and length per request, scatter start, offset, length."""


@dataclass(frozen=True, slots=True)
class Segment:
    """One future work request: a remote range and the local pieces it maps to, in order."""

    remote_offset: int
    length: int
    pieces: tuple[tuple[int, int], ...]
    """(local offset, length) for each scatter entry."""


@dataclass(frozen=True, slots=True, eq=False)
class Plan:
    """A checked batch cut into work requests, with offsets relative to the two regions.

    Request ``i`` moves ``length[i]`` bytes at ``remote_offset[i]``, gathering
    the local pieces ``sge_start[i]:sge_start[i + 1]`` of ``sge_offset`` /
    ``sge_length`` in order.
    """

    remote_offset: I64
    length: I64
    sge_start: I64
    sge_offset: I64
    sge_length: I64

    def __len__(self) -> int:
        return len(self.remote_offset)

    def segments(self) -> list[Segment]:
        """The plan as ``Segment`` values (for tests and messages)."""
        starts = self.sge_start.tolist()
        offs, lens = self.sge_offset.tolist(), self.sge_length.tolist()
        return [
            Segment(r, n, tuple(zip(offs[starts[i] : starts[i + 1]], lens[starts[i] : starts[i + 1]], strict=True)))
            for i, (r, n) in enumerate(zip(self.remote_offset.tolist(), self.length.tolist(), strict=True))
        ]


def _as_int64(values: Sequence[int] | npt.NDArray[np.integer], what: str) -> I64:
    """The values as an int64 array, or ``InvalidArgument`` naming the first one that is not an integer."""
    if isinstance(values, np.ndarray) and values.ndim == 1 and values.dtype.kind == "i":
        return values.astype(np.int64, copy=False)
    items: list[object] = values.tolist() if isinstance(values, np.ndarray) else list(values)
    try:
        arr = np.asarray(items)
    except (OverflowError, ValueError, TypeError):
        arr = np.asarray(items, dtype=object)
    kind = arr.dtype.kind
    if arr.ndim == 1 and (kind == "i" or (kind == "u" and (arr.size == 0 or int(arr.max()) <= _INT64_MAX))):
        return arr.astype(np.int64, copy=False)
    if not items:
        return np.zeros(0, dtype=np.int64)  # np.asarray([]) is float64: an empty list is fine
    # Slow path, for errors only (or ints past int64, which exceed every region anyway).
    out = []
    for i, v in enumerate(items):
        if isinstance(v, bool | np.bool_):  # operator.index(True) is 1: a flag is not an offset
            raise InvalidArgument(f"{what}[{i}] is bool, not an integer")
        if not isinstance(v, int):
            try:
                v = operator.index(v)  # type: ignore[arg-type]
            except TypeError:
                raise InvalidArgument(f"{what}[{i}] is {type(v).__name__}, not an integer") from None
        out.append(max(-_INT64_MAX, min(int(v), _INT64_MAX)))
    return np.asarray(out, dtype=np.int64)


def check_arrays(
    local_offsets: Sequence[int] | npt.NDArray[np.integer],
    remote_offsets: Sequence[int] | npt.NDArray[np.integer],
    sizes: Sequence[int] | npt.NDArray[np.integer],
    local_length: int,
    remote_length: int,
) -> tuple[I64, I64, I64]:
    """Validate a batch against both regions' lengths; return it as three int64 arrays.

    Raises ``InvalidArgument`` naming the first bad block. Nothing is posted
    when this raises, which is why every block is checked before any is planned.
    """
    lo = _as_int64(local_offsets, "local_offsets")
    ro = _as_int64(remote_offsets, "remote_offsets")
    sz = _as_int64(sizes, "sizes")
    if not (len(lo) == len(ro) == len(sz)):
        raise InvalidArgument(
            f"list lengths differ: {len(lo)} local offsets, {len(ro)} remote offsets, {len(sz)} sizes"
        )
    if not len(sz):
        raise InvalidArgument("empty batch: give at least one block")
    # ``length - sz`` can only wrap when ``sz`` is hugely negative, which ``sz <= 0`` flags anyway.
    bad = (sz <= 0) | (lo < 0) | (ro < 0) | (lo > local_length - sz) | (ro > remote_length - sz)
    if not bad.any():
        return lo, ro, sz
    i = int(np.argmax(bad))  # the first bad block, whatever is wrong with it
    _raise_for_block(i, int(lo[i]), int(ro[i]), int(sz[i]), local_length, remote_length)
    raise AssertionError("unreachable")  # pragma: no cover


def _raise_for_block(i: int, l_off: int, r_off: int, size: int, local_length: int, remote_length: int) -> None:
    if size <= 0:
        raise InvalidArgument(f"block {i}: size {size} must be positive")
    if l_off < 0 or r_off < 0:
        raise InvalidArgument(f"block {i}: offsets must be >= 0 (local {l_off}, remote {r_off})")
    if l_off + size > local_length:
        raise InvalidArgument(
            f"block {i}: local range [{l_off}, {l_off + size}) exceeds the local region ({local_length} bytes)"
        )
    raise InvalidArgument(
        f"block {i}: remote range [{r_off}, {r_off + size}) exceeds the remote region ({remote_length} bytes)"
    )


def check_few(
    local_offsets: object, remote_offsets: object, sizes: object, local_length: int, remote_length: int
) -> tuple[list[int], list[int], list[int]] | None:
    """``check_arrays`` for a batch of 1 to ``SMALL`` blocks given as lists or tuples of ints (or 1-D
    signed integer arrays), returning fresh int lists: the same values, the same errors. None, having
    checked nothing, for any other batch (``check_arrays`` then checks it, and words what is wrong)."""
    lo, ro, sz = _few_ints(local_offsets), _few_ints(remote_offsets), _few_ints(sizes)
    if lo is None or ro is None or sz is None or not 0 < len(lo) == len(ro) == len(sz):
        return None
    for i, (l_off, r_off, size) in enumerate(zip(lo, ro, sz, strict=True)):
        # check_arrays's test, on ints that fit int64 as it reads them: the first bad block is the same.
        if size <= 0 or l_off < 0 or r_off < 0 or l_off > local_length - size or r_off > remote_length - size:
            _raise_for_block(i, l_off, r_off, size, local_length, remote_length)
    return lo, ro, sz


def _few_ints(values: object) -> list[int] | None:
    """A new list of ``values`` if they are 1 to ``SMALL`` ints that int64 holds, else None."""
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or values.dtype.kind != "i" or len(values) > SMALL:
            return None
        return values.tolist()  # type: ignore[no-any-return]
    if (type(values) is not list and type(values) is not tuple) or len(values) > SMALL:
        return None
    for v in values:
        # Exactly int (not bool, not a numpy integer) and within int64, as numpy would read the list.
        if type(v) is not int or not _INT64_MIN <= v <= _INT64_MAX:
            return None
    return list(values)


def check_block(
    local_offset: int, remote_offset: int, size: int, local_length: int, remote_length: int
) -> tuple[int, int, int]:
    """One block, checked as ``check_arrays`` checks each block, with plain ints (the single read/write)."""
    if type(local_offset) is int and type(remote_offset) is int and type(size) is int:
        if size <= 0 or local_offset < 0 or remote_offset < 0:
            _raise_for_block(0, local_offset, remote_offset, size, local_length, remote_length)
        if local_offset + size > local_length or remote_offset + size > remote_length:
            _raise_for_block(0, local_offset, remote_offset, size, local_length, remote_length)
        return local_offset, remote_offset, size
    values = []
    for what, v in (("local_offset", local_offset), ("remote_offset", remote_offset), ("size", size)):
        if isinstance(v, bool | np.bool_):  # operator.index(True) is 1: a flag is not an offset
            raise InvalidArgument(f"{what} is bool, not an integer")
        if type(v) is not int:
            try:
                v = operator.index(v)
            except TypeError:
                raise InvalidArgument(f"{what} is {type(v).__name__}, not an integer") from None
        values.append(int(v))
    lo, ro, sz = values
    if sz <= 0 or lo < 0 or ro < 0 or lo + sz > local_length or ro + sz > remote_length:
        _raise_for_block(0, lo, ro, sz, local_length, remote_length)
    return lo, ro, sz


def check_blocks(
    local_offsets: Sequence[int],
    remote_offsets: Sequence[int],
    sizes: Sequence[int],
    local_length: int,
    remote_length: int,
) -> tuple[list[int], list[int], list[int]]:
    """``check_arrays`` with the values returned as plain int lists."""
    lo, ro, sz = check_arrays(local_offsets, remote_offsets, sizes, local_length, remote_length)
    return lo.tolist(), ro.tolist(), sz.tolist()


def merge_contiguous_blocks(
    local_offsets: Sequence[int], remote_offsets: Sequence[int], sizes: Sequence[int]
) -> tuple[list[int], list[int], list[int]]:
    """vLLM's rule: sort by local offset, merge neighbours contiguous on both sides."""
    if not len(sizes):
        return [], [], []
    lo, ro, sz = (np.asarray(v, dtype=np.int64) for v in (local_offsets, remote_offsets, sizes))
    order = np.argsort(lo, kind="stable")
    lo, ro, sz = lo[order], ro[order], sz[order]
    starts = _run_starts((lo[1:] == lo[:-1] + sz[:-1]) & (ro[1:] == ro[:-1] + sz[:-1]))
    return lo[starts].tolist(), ro[starts].tolist(), np.add.reduceat(sz, starts).tolist()


def _run_starts(joins_previous: npt.NDArray[np.bool_]) -> npt.NDArray[np.intp]:
    """Indices where a run starts, given for each element after the first whether it joins the one before."""
    return np.flatnonzero(np.concatenate(([True], ~joins_previous)))


def plan(lo: I64, ro: I64, sz: I64, *, max_sge: int, max_wr_bytes: int) -> Plan:
    """Group checked blocks into as few work requests as the limits allow.

    Blocks are taken in remote order; a block that continues the current
    request's remote range joins it (extending its last piece when the local
    side is contiguous too, else as a new scatter entry while fewer than
    ``max_sge``), unless the request would pass ``max_wr_bytes``.
    """
    if max_sge < 1 or max_wr_bytes < 1:
        raise InvalidArgument("max_sge and max_wr_bytes must be positive")
    if len(sz) == 1:  # the single read/write: no sort, no masks
        if int(sz[0]) <= max_wr_bytes:
            one = np.zeros(2, dtype=np.int64)
            one[1] = 1
            return Plan(ro.copy(), sz.copy(), one, lo.copy(), sz.copy())
    elif len(sz) > 1:
        order = np.lexsort((lo, ro))
        lo, ro, sz = lo[order], ro[order], sz[order]
    # Pieces: neighbours contiguous on both sides merge into one scatter entry.
    rend = ro[:-1] + sz[:-1]
    remote_joins = ro[1:] == rend
    if not remote_joins.any():
        # Nothing is remote-contiguous (scattered KV blocks): every block is a request of its own.
        if len(sz) and int(sz.max()) > max_wr_bytes:
            return _plan_greedy(lo.tolist(), ro.tolist(), sz.tolist(), max_sge, max_wr_bytes)
        return Plan(ro, sz, np.arange(len(sz) + 1, dtype=np.int64), lo, sz)
    p_start = _run_starts(remote_joins & (lo[1:] == lo[:-1] + sz[:-1]))
    p_local, p_remote = lo[p_start], ro[p_start]
    p_len = _sums(sz, p_start)
    # Runs: pieces contiguous on the remote side can share one request.
    r_start = _run_starts(p_remote[1:] == p_remote[:-1] + p_len[:-1])
    r_len = _sums(p_len, r_start)
    if int(r_len.max()) > max_wr_bytes:
        return _plan_greedy(p_local.tolist(), p_remote.tolist(), p_len.tolist(), max_sge, max_wr_bytes)
    # Within a run, consecutive pieces are never local-contiguous (they would have merged), so a
    # request is simply the next max_sge pieces of its run.
    run_of_piece = np.repeat(np.arange(len(r_start)), np.diff(np.append(r_start, len(p_start))))
    index_in_run = np.arange(len(p_start)) - r_start[run_of_piece]
    w_start = np.flatnonzero(index_in_run % max_sge == 0)
    return Plan(
        p_remote[w_start],
        _sums(p_len, w_start),
        np.append(w_start, len(p_start)).astype(np.int64),
        p_local,
        p_len,
    )


def _sums(values: I64, starts: npt.NDArray[np.intp]) -> I64:
    """``np.add.reduceat(values, starts)`` for run starts (``starts[0] == 0``, increasing), from one
    cumulative sum: reduceat pays tens of nanoseconds per segment, and here most segments are short."""
    total = np.cumsum(values)
    out = total[np.concatenate((starts[1:] - 1, [len(values) - 1]))]
    out[1:] -= total[starts[1:] - 1]
    return out


def plan_few(lo: list[int], ro: list[int], sz: list[int], *, max_sge: int, max_wr_bytes: int) -> FewPlan:
    """``plan`` of a few checked blocks (``check_few``), on ints: the same requests, as int lists."""
    if max_sge < 1 or max_wr_bytes < 1:
        raise InvalidArgument("max_sge and max_wr_bytes must be positive")
    if len(sz) > 1:
        # In remote order, then local (np.lexsort((lo, ro)) is stable too: ties keep their order).
        order = sorted(range(len(sz)), key=lambda i: (ro[i], lo[i]))
        lo, ro, sz = [lo[i] for i in order], [ro[i] for i in order], [sz[i] for i in order]
    return _walk(lo, ro, sz, max_sge, max_wr_bytes)


def _plan_greedy(p_local: list[int], p_remote: list[int], p_len: list[int], max_sge: int, max_wr_bytes: int) -> Plan:
    """The byte-cutting case: walk the merged pieces, cutting requests at ``max_wr_bytes``."""
    return Plan(*(np.asarray(v, dtype=np.int64) for v in _walk(p_local, p_remote, p_len, max_sge, max_wr_bytes)))


def _walk(p_local: list[int], p_remote: list[int], p_len: list[int], max_sge: int, max_wr_bytes: int) -> FewPlan:
    """Blocks in remote order into requests: a block continuing the open request's remote range joins
    it (extending its last piece when local-contiguous too, else as a new scatter entry while fewer
    than ``max_sge``), cut at ``max_wr_bytes``. Without a cut this is exactly what ``plan``'s array
    passes build; with one, it is how ``plan`` cuts."""
    w_remote: list[int] = []
    w_len: list[int] = []
    w_start: list[int] = []
    s_off: list[int] = []
    s_len: list[int] = []
    cur_remote = cur_len = 0
    open_request = False
    for l_off, r_off, size in zip(p_local, p_remote, p_len, strict=True):
        while size > 0:
            joins = open_request and r_off == cur_remote + cur_len and cur_len < max_wr_bytes
            if joins and s_off[-1] + s_len[-1] == l_off:
                take = min(size, max_wr_bytes - cur_len)
                s_len[-1] += take
            elif joins and len(s_off) - w_start[-1] < max_sge:
                take = min(size, max_wr_bytes - cur_len)
                s_off.append(l_off)
                s_len.append(take)
            else:
                if open_request:
                    w_len.append(cur_len)
                take = min(size, max_wr_bytes)
                cur_remote, cur_len, open_request = r_off, 0, True
                w_remote.append(r_off)
                w_start.append(len(s_off))
                s_off.append(l_off)
                s_len.append(take)
            cur_len += take
            l_off += take
            r_off += take
            size -= take
    if open_request:
        w_len.append(cur_len)
    w_start.append(len(s_off))
    return w_remote, w_len, w_start, s_off, s_len


def plan_segments(
    local_offsets: Sequence[int],
    remote_offsets: Sequence[int],
    sizes: Sequence[int],
    *,
    max_sge: int,
    max_wr_bytes: int,
) -> list[Segment]:
    """``plan`` of plain int lists, as ``Segment`` values."""
    lo, ro, sz = (np.asarray(v, dtype=np.int64) for v in (local_offsets, remote_offsets, sizes))
    return plan(lo, ro, sz, max_sge=max_sge, max_wr_bytes=max_wr_bytes).segments()
