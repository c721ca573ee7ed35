"""Work requests and work completions: the verbs-shaped values every backend speaks.

These mirror ``ibv_sge``, ``ibv_send_wr`` and ``ibv_wc`` closely enough that the
verbs backend translates them field by field, and the TCP backend emulates the
same contract.

The data path speaks ``WorkBatch``: many work requests as columns of numpy
arrays, so a batch of thousands of KV-cache blocks is checked, planned, posted
and accounted without a Python object per request. ``WorkRequest`` is the
one-request view of the same thing, for tests, hooks and error messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .status import Opcode, WcStatus

__all__ = ["Sge", "WorkBatch", "WorkCompletion", "WorkRequest", "cached_key_pairs"]

U64 = npt.NDArray[np.uint64]
U32 = npt.NDArray[np.uint32]
I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]
Bools = npt.NDArray[np.bool_]


def _frozen(a: npt.NDArray[Any]) -> npt.NDArray[Any]:
    a.flags.writeable = False
    return a


# Shared by every one-request batch (``WorkBatch.one``): batch arrays are never written.
_ONE_SGE = _frozen(np.array((0, 1), dtype=np.int64))
_SIGNALED_ONE = _frozen(np.ones(1, dtype=np.bool_))
_OPCODE_ONE = {op: _frozen(np.array((int(op),), dtype=np.uint8)) for op in Opcode}
_KEYS: dict[tuple[int, int], tuple[U32, U32]] = {}


def _keys(rkey: int, lkey: int) -> tuple[U32, U32]:
    """A pair of keys as one-element arrays, made once (a session posts under the same pair)."""
    if len(_KEYS) >= 1024:
        _KEYS.clear()
    both = _frozen(np.array((rkey, lkey), dtype=np.uint32))
    keys = _KEYS[rkey, lkey] = (both[0:1], both[1:2])
    return keys


def cached_key_pairs() -> int:
    """How many (rkey, lkey) pairs one-request batches hold as arrays now (at most 1024; inspection)."""
    return len(_KEYS)


@dataclass(frozen=True, slots=True)
class Sge:
    """One scatter/gather entry: ``length`` bytes at ``addr`` of the local region ``lkey``."""

    addr: int
    length: int
    lkey: int


@dataclass(frozen=True, slots=True)
class WorkRequest:
    """One RDMA READ or WRITE between a local scatter list and one remote range.

    ``signaled`` asks for a completion on success; a failed or flushed request
    always completes, signaled or not, so nothing posted is ever lost.
    """

    wr_id: int
    opcode: Opcode
    sges: tuple[Sge, ...]
    remote_addr: int
    rkey: int
    signaled: bool = True

    @property
    def length(self) -> int:
        return sum(s.length for s in self.sges)


@dataclass(slots=True, eq=False)
class WorkBatch:
    """``n`` work requests as parallel arrays; request ``i`` has wr_id ``wr_id + i``.

    Request ``i`` gathers (WRITE) or scatters (READ) the local entries
    ``sge_start[i]:sge_start[i + 1]`` of the ``sge_*`` arrays, and moves
    ``length[i]`` bytes (their sum) to or from ``remote_addr[i]`` under
    ``rkey[i]``. wr_ids are consecutive because one queue pair's requests
    are numbered in posting order; a completion then names a position.

    The arrays are never written after posting; backends read them
    (vectorised checks, ``tolist()`` once for loops) and keep no reference
    past the completions of the requests. (Not a frozen dataclass: frozen
    fields cost a ``object.__setattr__`` each, on the path of every single
    read or write.)
    """

    wr_id: int
    opcode: U8
    """Each request's ``Opcode`` value (RDMA_READ or RDMA_WRITE)."""
    remote_addr: U64
    rkey: U32
    length: U64
    signaled: Bools
    """Whether a request completes when it succeeds; a later signaled completion covers an unsignaled one."""
    sge_start: I64
    sge_addr: U64
    sge_length: U64
    sge_lkey: U32
    """The local key of the registered region each entry lies in."""

    def __len__(self) -> int:
        return len(self.opcode)

    @property
    def last_wr_id(self) -> int:
        return self.wr_id + len(self.opcode) - 1

    def request(self, i: int) -> WorkRequest:
        """Request ``i`` as a ``WorkRequest`` (slow path: hooks, errors, tests)."""
        a, b = int(self.sge_start[i]), int(self.sge_start[i + 1])
        sges = tuple(
            Sge(int(addr), int(n), int(key))
            for addr, n, key in zip(self.sge_addr[a:b], self.sge_length[a:b], self.sge_lkey[a:b], strict=True)
        )
        return WorkRequest(
            self.wr_id + i,
            Opcode(int(self.opcode[i])),
            sges,
            int(self.remote_addr[i]),
            int(self.rkey[i]),
            bool(self.signaled[i]),
        )

    def requests(self) -> list[WorkRequest]:
        return [self.request(i) for i in range(len(self))]

    def slice(self, start: int, stop: int | None = None) -> WorkBatch:
        """Requests ``start:stop`` as a batch of their own (views, no copy of the request columns)."""
        n = len(self)
        stop = n if stop is None else min(stop, n)
        start = max(0, min(start, stop))
        a, b = int(self.sge_start[start]), int(self.sge_start[stop])
        return WorkBatch(
            self.wr_id + start,
            self.opcode[start:stop],
            self.remote_addr[start:stop],
            self.rkey[start:stop],
            self.length[start:stop],
            self.signaled[start:stop],
            self.sge_start[start : stop + 1] - a,
            self.sge_addr[a:b],
            self.sge_length[a:b],
            self.sge_lkey[a:b],
        )

    @classmethod
    def one(
        cls, wr_id: int, opcode: Opcode, local_addr: int, lkey: int, remote_addr: int, rkey: int, length: int
    ) -> WorkBatch:
        """One signaled request with one scatter entry (the single read or write): a handful of tiny
        arrays, the constant ones shared (read-only) by every such batch, the keys by every batch under
        the same pair of keys."""
        v = np.empty(3, dtype=np.uint64)  # filled item by item: faster than converting a tuple
        v[0] = remote_addr
        v[1] = length
        v[2] = local_addr
        keys = _KEYS.get((rkey, lkey))
        if keys is None:
            keys = _keys(rkey, lkey)
        one = v[1:2]
        ops = _OPCODE_ONE.get(opcode)
        if ops is None:  # not an Opcode: the backend's post refuses it, as it would any batch holding it
            ops = np.array((int(opcode),), dtype=np.uint8)
        return cls(wr_id, ops, v[0:1], keys[0], one, _SIGNALED_ONE, _ONE_SGE, v[2:3], one, keys[1])

    @classmethod
    def singles(cls, wr_id: int, rows: Sequence[tuple[Opcode, int, int, int, int, int]]) -> WorkBatch:
        """Single requests with consecutive wr_ids from ``wr_id``, each ``(opcode, local_addr, lkey,
        remote_addr, rkey, length)`` with one scatter entry and signaled, as one batch (``one``'s values,
        many at once): the single reads and writes a channel posts together."""
        n = len(rows)
        cols = np.array(rows, dtype=np.uint64).T.copy()  # one conversion, then a contiguous row per column
        length = cols[5]
        return cls(
            wr_id,
            cols[0].astype(np.uint8),
            cols[3],
            cols[4].astype(np.uint32),
            length,
            np.ones(n, dtype=np.bool_),
            np.arange(n + 1, dtype=np.int64),
            cols[1],
            length,
            cols[2].astype(np.uint32),
        )

    @classmethod
    def from_requests(cls, wrs: Sequence[WorkRequest]) -> WorkBatch:
        """Pack ``WorkRequest`` values (wr_ids must be consecutive) into a batch."""
        if not wrs:
            return cls.empty()
        if len(wrs) == 1 and len(wrs[0].sges) == 1:
            # One request, one entry (the single read or write): no generality to pay for.
            wr, sge = wrs[0], wrs[0].sges[0]
            v = np.array((wr.remote_addr, sge.length, sge.addr), dtype=np.uint64)
            return cls(
                wr.wr_id,
                np.array((int(wr.opcode),), dtype=np.uint8),
                v[0:1],
                np.array((wr.rkey,), dtype=np.uint32),
                v[1:2],
                np.array((wr.signaled,), dtype=np.bool_),
                _ONE_SGE,
                v[2:3],
                v[1:2],
                np.array((sge.lkey,), dtype=np.uint32),
            )
        first = wrs[0].wr_id
        for i, wr in enumerate(wrs):
            if wr.wr_id != first + i:
                raise ValueError(f"wr_ids must be consecutive: request {i} has {wr.wr_id}, expected {first + i}")
        counts = [len(wr.sges) for wr in wrs]
        sges = [s for wr in wrs for s in wr.sges]
        start = np.zeros(len(wrs) + 1, dtype=np.int64)
        np.cumsum(counts, out=start[1:])
        return cls(
            first,
            np.fromiter((int(wr.opcode) for wr in wrs), dtype=np.uint8, count=len(wrs)),
            np.fromiter((wr.remote_addr for wr in wrs), dtype=np.uint64, count=len(wrs)),
            np.fromiter((wr.rkey for wr in wrs), dtype=np.uint32, count=len(wrs)),
            np.fromiter((wr.length for wr in wrs), dtype=np.uint64, count=len(wrs)),
            np.fromiter((wr.signaled for wr in wrs), dtype=np.bool_, count=len(wrs)),
            start,
            np.fromiter((s.addr for s in sges), dtype=np.uint64, count=len(sges)),
            np.fromiter((s.length for s in sges), dtype=np.uint64, count=len(sges)),
            np.fromiter((s.lkey for s in sges), dtype=np.uint32, count=len(sges)),
        )

    @classmethod
    def empty(cls) -> WorkBatch:
        z64 = np.zeros(0, dtype=np.uint64)
        return cls(
            0,
            np.zeros(0, dtype=np.uint8),
            z64,
            np.zeros(0, dtype=np.uint32),
            z64,
            np.zeros(0, dtype=np.bool_),
            np.zeros(1, dtype=np.int64),
            z64,
            z64,
            np.zeros(0, dtype=np.uint32),
        )


@dataclass(slots=True, unsafe_hash=True)
class WorkCompletion:
    """What a completion queue reports for one work request.

    Treat it as immutable. (Not a frozen dataclass, like ``WorkBatch``: a frozen
    field costs an ``object.__setattr__`` each, and backends make one of these
    per signaled request; equality and hashing are by value as before.)
    """

    wr_id: int
    status: WcStatus
    opcode: Opcode
    byte_len: int
    qp_num: int
    vendor_err: int = 0

    @property
    def ok(self) -> bool:
        return self.status is WcStatus.SUCCESS
