"""The KV block pool of one instance: one cache array, registered once, and block accounting.

Every block is free or allocated; an allocated block may also be in flight (a
transfer reads or writes it, or a peer was lent it to read). The accounting is
what ``/status`` and ``/metrics`` show, and what the leak checks read: after the
last request every count but ``free`` is back to zero.

Only the event-loop thread allocates and frees; the model's worker thread and
the NIC touch the array's bytes, never the accounting.
"""

from __future__ import annotations

import asyncio
import heapq
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import msgspec
import numpy as np
import numpy.typing as npt

__all__ = ["KVLayout", "KVPool", "PoolExhausted", "transfer_segments"]


class PoolExhausted(Exception):
    """No room for a request's blocks within its admission deadline."""


class KVLayout(msgspec.Struct, frozen=True):
    """Where block ``b`` of K or V at layer ``l`` lives in a pool's registered buffer.

    The buffer is ``(layers, 2, num_blocks, block_size, heads, head_dim)``, so the
    byte offset of a block is ``((layer * 2 + kv) * num_blocks + block) * block_bytes``.
    Peers exchange layouts because their ``num_blocks`` may differ.
    """

    layers: int
    num_blocks: int
    block_bytes: int

    def offset(self, layer: int, kv: int, block: int) -> int:
        return ((layer * 2 + kv) * self.num_blocks + block) * self.block_bytes

    def check_blocks(self, ids: Sequence[int]) -> None:
        """``ValueError`` unless ``ids`` are distinct block ids of this layout."""
        if any(not 0 <= b < self.num_blocks for b in ids) or len(set(ids)) != len(ids):
            raise ValueError(f"block ids must be distinct and within 0..{self.num_blocks - 1}")


def transfer_segments(
    local: KVLayout, local_ids: Sequence[int], remote: KVLayout, remote_ids: Sequence[int], layer: int
) -> tuple[list[int], list[int], list[int]]:
    """One layer's K and V blocks as (local offsets, remote offsets, sizes), contiguous runs merged.

    Block ``local_ids[i]`` pairs with ``remote_ids[i]``. As in vLLM's
    ``merge_contiguous_blocks``, pairs are sorted by local id and two neighbours
    merge only when both sides are contiguous.
    """
    if len(local_ids) != len(remote_ids):
        raise ValueError("local and remote block lists differ in length")
    if local.block_bytes != remote.block_bytes or local.layers != remote.layers:
        raise ValueError(f"incompatible KV layouts: {local} vs {remote}")
    pairs = sorted(zip(local_ids, remote_ids, strict=True))
    runs: list[tuple[int, int, int]] = []  # (first local, first remote, length)
    for lo, ro in pairs:
        if runs and lo == runs[-1][0] + runs[-1][2] and ro == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((lo, ro, 1))
    lo_offs: list[int] = []
    ro_offs: list[int] = []
    sizes: list[int] = []
    for kv in (0, 1):
        for lo, ro, n in runs:
            lo_offs.append(local.offset(layer, kv, lo))
            ro_offs.append(remote.offset(layer, kv, ro))
            sizes.append(n * local.block_bytes)
    return lo_offs, ro_offs, sizes


class KVPool:
    """A paged KV cache array and its block accounting (allocated / free / in flight)."""

    def __init__(self, array: npt.NDArray[np.float32]) -> None:
        if array.ndim != 6 or array.shape[1] != 2 or not array.flags.c_contiguous:
            raise ValueError("the cache must be a C-contiguous (layers, 2, blocks, block_size, heads, head_dim) array")
        self.array = array
        layers, _, blocks = array.shape[:3]
        self.layout = KVLayout(layers, blocks, int(np.prod(array.shape[3:])) * array.itemsize)
        self._free = list(range(blocks))  # a heap: lowest ids first keeps requests' blocks contiguous
        self._allocated: set[int] = set()
        self._in_flight: Counter[int] = Counter()
        self._freed = asyncio.Event()
        self.peak = 0

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def allocated_blocks(self) -> int:
        return len(self._allocated)

    @property
    def in_flight_blocks(self) -> int:
        return len(self._in_flight)

    def stats(self) -> dict[str, int]:
        return {
            "capacity": self.num_blocks,
            "free": self.free_blocks,
            "allocated": self.allocated_blocks,
            "in_flight": self.in_flight_blocks,
            "peak": self.peak,
        }

    def try_allocate(self, n: int) -> list[int] | None:
        """``n`` blocks now, or ``None`` when fewer are free."""
        if not 0 < n <= self.num_blocks:
            raise ValueError(f"a request needs 1..{self.num_blocks} blocks, not {n}")
        if len(self._free) < n:
            return None
        ids = [heapq.heappop(self._free) for _ in range(n)]
        self._allocated.update(ids)
        self.peak = max(self.peak, len(self._allocated))
        return ids

    async def allocate(self, n: int, timeout: float) -> list[int]:
        """``n`` blocks, waiting up to ``timeout`` seconds for frees; ``PoolExhausted`` after that."""
        try:
            async with asyncio.timeout(timeout):
                while (ids := self.try_allocate(n)) is None:
                    self._freed.clear()
                    await self._freed.wait()
        except TimeoutError:
            raise PoolExhausted(
                f"no {n} free KV blocks within {timeout:g}s ({self.free_blocks}/{self.num_blocks} free)"
            ) from None
        return ids

    def free(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        for b in ids:
            if b not in self._allocated:
                raise ValueError(f"block {b} is not allocated")
            if self._in_flight[b]:
                raise ValueError(f"block {b} is still in flight")
        for b in ids:
            self._allocated.discard(b)
            heapq.heappush(self._free, b)
        self._freed.set()

    def begin_flight(self, ids: Sequence[int]) -> None:
        """Mark allocated blocks as in flight (a transfer moves them, or a peer was lent them)."""
        for b in ids:
            if b not in self._allocated:
                raise ValueError(f"block {b} is not allocated")
        self._in_flight.update(ids)

    def end_flight(self, ids: Sequence[int]) -> None:
        for b in ids:
            if self._in_flight[b] <= 1:
                del self._in_flight[b]
            else:
                self._in_flight[b] -= 1

    @contextmanager
    def in_flight(self, ids: Sequence[int]) -> Iterator[None]:
        """``begin_flight`` for the body of a ``with``."""
        self.begin_flight(ids)
        try:
            yield
        finally:
            self.end_flight(ids)
