"""Registered memory: the region table, key allocation, exports, and the checks a NIC makes.

Keys are drawn from a keyed permutation of a counter (``KeyStream``): random
to a peer, and never repeated within a backend, without remembering the keys
handed out.

Exports: the target's checks find a region by rkey only once it was exported
(``RegionTable.export``); until then its rkey is unknown to the data plane
(``REM_ACCESS_ERR``, ``UNKNOWN_RKEY``: a peer cannot even tell it exists).

Deregistration races with requests being served on other threads. A region is
*pinned* for exactly as long as a socket call reads or writes its bytes, and
``RegionTable.deregister`` first marks it dead (no new pin succeeds, and its
keys are gone from the table). A pin taken for a peer's request names its
holder (the responder serving it, an ``Abortable``): deregistration aborts
every such holder (a socket shutdown, which ends the socket call at once
however slowly the peer sends), then waits for the pins to drop, which is
then as long as a woken system call takes to return. So once deregistration
returns, no byte of the buffer is read or written again, and a peer cannot
make it wait. The initiator's own sends and receives pin with their queue pair
as the holder: its abort shuts the pair's socket down and the pair fails
(LOC_PROT_ERR, LOCAL_DEREGISTERED), as deregistering a region under a posted
request fails it on a NIC; a peer reading a WRITE slowly cannot make the
deregistration wait either. Pins without a holder are waited for.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from ...errors import InvalidArgument
from ...status import Access, Opcode
from ..base import MemoryRegion
from ..soft.pair import address_of
from .wire import VendorErr

__all__ = ["ABORT_GRACE", "Abortable", "Checked", "KeyStream", "RegionTable", "TcpRegion", "unpin_all"]

log = logging.getLogger("moriio_async.tcp")

ABORT_GRACE = 2.0
"""Most seconds deregistration waits for aborted socket calls to return (microseconds in practice:
a shut-down socket's call returns at once; this bounds only a starved thread)."""

U32 = npt.NDArray[np.uint32]
U64 = npt.NDArray[np.uint64]


class Abortable(Protocol):
    """Who holds a pin (a responder serving a peer's request, or a pair moving the initiator's own
    bytes): can end its socket call at once, from any thread."""

    def abort(self) -> None:
        """End the socket call moving this region's bytes (a shutdown); the holder then unpins.

        Called with the region's lock held: it must not pin, unpin or block."""


@dataclass(eq=False, slots=True)
class TcpRegion(MemoryRegion):
    """A registered buffer with its liveness, export and pins (by holder)."""

    can_local_write: bool = False
    can_remote_write: bool = False
    can_remote_read: bool = False
    live: bool = True
    exported: bool = False
    pins: int = 0
    holders: dict[Abortable, int] = field(default_factory=dict, repr=False)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    drained: threading.Event = field(default_factory=threading.Event, repr=False)

    def pin(self, holder: Abortable | None = None) -> bool:
        """Hold the region alive for one socket call; False when it was deregistered."""
        with self.lock:
            if not self.live:
                return False
            self.pins += 1
            if holder is not None:
                self.holders[holder] = self.holders.get(holder, 0) + 1
            return True

    def unpin(self, holder: Abortable | None = None) -> None:
        with self.lock:
            self.pins -= 1
            if holder is not None:
                left = self.holders.pop(holder, 1) - 1
                if left:
                    self.holders[holder] = left
            if not self.pins and not self.live:
                self.drained.set()

    def kill(self, wait: bool = True) -> None:
        """Mark dead, abort the peers' socket calls on it, and wait until no socket call touches the
        buffer (``wait=False``: once no thread that could make one is left, see ``RegionTable.clear``)."""
        with self.lock:
            self.live = False
            if not self.pins:
                return
            if not wait:
                log.warning("tcp region %#x: %d pin(s) left with no socket call to end them (a leak)",
                            self.addr, self.pins)  # fmt: skip
                return
            only_peers = sum(self.holders.values()) == self.pins
            # Under the lock: a holder cannot unpin meanwhile, so its abort is about this region's
            # pin and never lands on its next request (which may be moving another region's bytes).
            for holder in self.holders:
                holder.abort()
        if only_peers:
            if not self.drained.wait(ABORT_GRACE):
                log.warning("tcp region %#x: aborted socket calls still hold it after %gs", self.addr, ABORT_GRACE)
                self.drained.wait()
            return
        self.drained.wait()


class KeyStream:
    """32-bit keys that look random and never repeat: a keyed 4-round Feistel permutation of a counter.

    A permutation of 2**32 values applied to 0, 1, 2, ... gives distinct outputs
    until the counter wraps (four billion registrations), with no set of used
    keys to keep; the key is secret and per backend, so a peer that saw some
    rkeys cannot predict the next one. 0 is skipped (no region has key 0).
    """

    def __init__(self) -> None:
        self._key = secrets.token_bytes(16)
        self._counter = 0
        self._lock = threading.Lock()

    def _round(self, half: int, i: int) -> int:
        digest = hashlib.blake2s(struct.pack("<HB", half, i), key=self._key, digest_size=2).digest()
        return int.from_bytes(digest, "little")

    def permute(self, x: int) -> int:
        left, right = x >> 16, x & 0xFFFF
        for i in range(4):
            left, right = right, left ^ self._round(right, i)
        return (left << 16) | right

    def next(self) -> int:
        while True:
            with self._lock:
                n = self._counter
                self._counter = (n + 1) & 0xFFFFFFFF
            key = self.permute(n)
            if key:
                return key


class RegionTable:
    """The backend's regions by lkey and by rkey. Lookups are lock-free dict reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.by_lkey: dict[int, TcpRegion] = {}
        self.by_rkey: dict[int, TcpRegion] = {}
        """Exported regions only: what a peer's rkey can name."""
        self._keys = KeyStream()  # never repeats, so a stale key never hits a new region

    def _new_key(self) -> int:
        return self._keys.next()

    def register(self, buffer: memoryview, access: Access) -> TcpRegion:
        view = buffer if buffer.format == "B" and buffer.ndim == 1 else buffer.cast("B")
        if access & Access.REMOTE_WRITE and not access & Access.LOCAL_WRITE:
            # ibv_reg_mr refuses this (EINVAL); refusing it here too keeps the backends alike.
            raise InvalidArgument(
                "REMOTE_WRITE access needs LOCAL_WRITE too", hint="register with Access.LOCAL_WRITE | REMOTE_WRITE"
            )
        with self._lock:
            region = TcpRegion(
                addr=address_of(view),
                length=view.nbytes,
                lkey=self._new_key(),
                rkey=self._new_key(),
                access=access,
                view=view,
                can_local_write=bool(access & Access.LOCAL_WRITE),
                can_remote_write=bool(access & Access.REMOTE_WRITE),
                can_remote_read=bool(access & Access.REMOTE_READ),
            )
            self.by_lkey[region.lkey] = region
        return region

    def export(self, region: MemoryRegion) -> None:
        """Make ``region`` reachable by peers on the data plane (its rkey is found from now on). Idempotent."""
        with self._lock:
            found = self.by_lkey.get(region.lkey)
            if found is not region or not found.live:
                return
            found.exported = True
            self.by_rkey[found.rkey] = found

    def deregister(self, region: MemoryRegion) -> None:
        """Forget the keys, then wait for in-progress socket calls on the buffer. Idempotent."""
        with self._lock:
            found = self.by_lkey.get(region.lkey)
            if found is not region:
                return
            del self.by_lkey[region.lkey]
            self.by_rkey.pop(region.rkey, None)
        found.kill()

    def clear(self) -> None:
        """Forget every region, once the backend joined all its NIC threads (its ``close``): no
        socket call can touch a buffer then, so a pin still held is a leak, logged and not waited
        for (the wait would never end, and ``close`` would never return)."""
        with self._lock:
            regions = list(self.by_lkey.values())
            self.by_lkey.clear()
            self.by_rkey.clear()
        for region in regions:
            region.kill(wait=False)

    def check_local(self, lkeys: U32, addrs: U64, lengths: U64, write: bool) -> Checked:
        """The initiator's checks on local SGEs (``write``: the NIC writes them, as a READ does). Pins nothing."""
        return _check(self.by_lkey, lkeys, addrs, lengths, _LOCAL, _LOCAL_WRITE if write else _LOCAL_READ)

    def check_remote(
        self, opcode: int, rkeys: U32, addrs: U64, lengths: U64, holder: Abortable | None = None
    ) -> Checked:
        """The target's checks on a chunk's remote ranges, with the regions of the requests before
        the first failure pinned by ``holder`` (one deregistered meanwhile fails there as REMOTE_DEREGISTERED)."""
        allowed = _REMOTE_WRITE if opcode == Opcode.RDMA_WRITE else _REMOTE_READ
        return _pinned(_check(self.by_rkey, rkeys, addrs, lengths, _REMOTE, allowed), holder)

    def check_local_one(self, lkey: int, addr: int, length: int, write: bool) -> Checked:
        """``check_local`` for one SGE, on plain integers."""
        return _check_one(self.by_lkey, lkey, addr, length, _LOCAL, _LOCAL_WRITE if write else _LOCAL_READ)

    def check_remote_one(
        self, opcode: int, rkey: int, addr: int, length: int, holder: Abortable | None = None
    ) -> Checked:
        """``check_remote`` for one request, on plain integers (pinned likewise)."""
        allowed = _REMOTE_WRITE if opcode == Opcode.RDMA_WRITE else _REMOTE_READ
        return _pinned(_check_one(self.by_rkey, rkey, addr, length, _REMOTE, allowed), holder)


@dataclass(slots=True)
class Checked:
    """Blocks checked at once: the first that failed (``first_bad``; their count when none did)
    and why; block ``i`` lies in ``found[which[i]]``; ``pinned`` is what ``pin`` holds."""

    first_bad: int
    vendor: VendorErr
    found: list[TcpRegion | None]
    which: npt.NDArray[np.intp]
    pinned: list[TcpRegion] = field(default_factory=list)
    holder: Abortable | None = None
    """Who the pins are held for (a responder, which deregistration can abort)."""

    def used(self) -> list[tuple[int, TcpRegion]]:
        """The regions (with their index in ``found``) that the blocks before the first failure use."""
        if not self.first_bad:
            return []
        js = [0] if len(self.found) == 1 else np.unique(self.which[: self.first_bad]).tolist()
        return [(j, r) for j in js if (r := self.found[j]) is not None]

    def pin(self, dead: VendorErr) -> None:
        """Pin every region in use; a region deregistered since the lookup fails the first block
        that uses it with ``dead``, and what lies beyond that block is not pinned."""
        if len(self.found) == 1:  # one region (the usual case): no bookkeeping
            region = self.found[0]
            if self.first_bad and region is not None:
                if region.pin(self.holder):
                    self.pinned.append(region)
                else:
                    self.first_bad, self.vendor = 0, dead
            return
        for j, region in self.used():
            if region.pin(self.holder):
                self.pinned.append(region)
                continue
            first_use = int(np.argmax(self.which == j)) if len(self.found) > 1 else 0
            if first_use < self.first_bad:
                self.first_bad, self.vendor = first_use, dead
        if self.pinned and len(self.pinned) != len(still := self.used()):
            keep = {id(r) for _, r in still}
            for region in [r for r in self.pinned if id(r) not in keep]:
                region.unpin(self.holder)
            self.pinned = [r for r in self.pinned if id(r) in keep]

    def unpin(self) -> None:
        unpin_all(self.pinned, self.holder)


_ZERO = np.zeros(1, dtype=np.intp)
_ZERO.flags.writeable = False


def unpin_all(regions: list[TcpRegion], holder: Abortable | None = None) -> None:
    for region in regions:
        region.unpin(holder)
    regions.clear()


class _Refusals(NamedTuple):
    """What a check fails with, on one side: an unknown key, a range outside its region, an access the
    region does not grant."""

    unknown: VendorErr
    out_of_bounds: VendorErr
    no_access: VendorErr


_LOCAL = _Refusals(VendorErr.UNKNOWN_LKEY, VendorErr.LOCAL_OUT_OF_BOUNDS, VendorErr.LOCAL_NO_ACCESS)
_REMOTE = _Refusals(VendorErr.UNKNOWN_RKEY, VendorErr.REMOTE_OUT_OF_BOUNDS, VendorErr.REMOTE_NO_ACCESS)
# What each check allows, made once (not a closure per request).
_LOCAL_READ: Callable[[TcpRegion], bool] = lambda r: r.live  # noqa: E731
_LOCAL_WRITE: Callable[[TcpRegion], bool] = lambda r: r.live and r.can_local_write  # noqa: E731
_REMOTE_READ: Callable[[TcpRegion], bool] = lambda r: r.can_remote_read  # noqa: E731
_REMOTE_WRITE: Callable[[TcpRegion], bool] = lambda r: r.can_remote_write  # noqa: E731


def _pinned(checked: Checked, holder: Abortable | None) -> Checked:
    """A remote check's regions pinned by ``holder`` (one deregistered meanwhile fails as REMOTE_DEREGISTERED)."""
    checked.holder = holder
    checked.pin(VendorErr.REMOTE_DEREGISTERED)
    return checked


def _check(
    table: dict[int, TcpRegion], keys: U32, addrs: U64, lengths: U64, refusals: _Refusals,
    allowed: Callable[[TcpRegion], bool],
) -> Checked:  # fmt: skip
    """Key to region, bounds and access for every block with a few array operations and one
    dict lookup per distinct key (usually one)."""
    n = len(keys)
    if n == 1:  # one block: plain integers, no array work
        return _check_one(table, keys.item(0), addrs.item(0), lengths.item(0), refusals, allowed)
    unknown, out_of_bounds, no_access = refusals
    if n and bool((keys == keys[0]).all()):
        found = [table.get(keys.item(0))]
        which = np.zeros(n, dtype=np.intp)
    elif n:
        uniq, which = np.unique(keys, return_inverse=True)
        found = [table.get(k) for k in uniq.tolist()]
    else:
        return Checked(0, VendorErr.NONE, [], np.zeros(0, np.intp))
    codes = [unknown if r is None else VendorErr.NONE if allowed(r) else no_access for r in found]
    base: U64 | np.uint64
    size: U64 | np.uint64
    region_bad: npt.NDArray[np.bool_] | bool
    if len(found) == 1:
        only = found[0]
        base, size = (np.uint64(0), np.uint64(0)) if only is None else (np.uint64(only.addr), np.uint64(only.length))
        region_bad = codes[0] != VendorErr.NONE
    else:
        base = np.array([0 if r is None else r.addr for r in found], dtype=np.uint64)[which]
        size = np.array([0 if r is None else r.length for r in found], dtype=np.uint64)[which]
        region_bad = np.array([c != VendorErr.NONE for c in codes], dtype=np.bool_)[which]
    offset = addrs - base  # wraps for addresses below the region: those fail addrs >= base
    inside = (addrs >= base) & (offset <= size) & (lengths <= size - offset)
    bad = ~inside | region_bad
    first = int(np.argmax(bad)) if bool(bad.any()) else n
    vendor = VendorErr.NONE
    if first < n:
        code = codes[int(which[first])]
        vendor = unknown if code == unknown else out_of_bounds if not bool(inside[first]) else code
    return Checked(first, vendor, found, which)


def _check_one(
    table: dict[int, TcpRegion], key: int, addr: int, length: int, refusals: _Refusals,
    allowed: Callable[[TcpRegion], bool],
) -> Checked:  # fmt: skip
    region = table.get(key)
    if region is None:
        vendor = refusals.unknown
    elif not (region.addr <= addr and length >= 0 and addr + length <= region.addr + region.length):
        vendor = refusals.out_of_bounds
    else:
        vendor = VendorErr.NONE if allowed(region) else refusals.no_access
    return Checked(0 if vendor else 1, vendor, [region], _ZERO)
