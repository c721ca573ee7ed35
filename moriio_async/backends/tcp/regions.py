"""Registered memory: the region table, key allocation, and the checks a NIC makes.

Deregistration races with requests being served on other threads. A region is
*pinned* for exactly as long as a socket call reads or writes its bytes, and
``RegionTable.deregister`` first marks it dead (no new pin succeeds, and its
keys are gone from the table), then waits for the pins to drop. So once
deregistration returns, no byte of the buffer is read or written again. The
wait is as long as one in-progress socket call (a READ's response is
received with its region pinned), which the silence timeout bounds even
against a stalled peer (one to two ``retry_timeout``s).
"""

from __future__ import annotations

import ctypes
import secrets
import threading
from dataclasses import dataclass, field

from ...errors import InvalidArgument
from ...status import Access, Opcode
from ..base import MemoryRegion
from .wire import VendorErr

__all__ = ["RegionTable", "TcpRegion"]


@dataclass(eq=False, slots=True)
class TcpRegion(MemoryRegion):
    """A registered buffer with its liveness and pin count."""

    can_local_write: bool = False
    can_remote_write: bool = False
    can_remote_read: bool = False
    live: bool = True
    pins: int = 0
    cond: threading.Condition = field(default_factory=threading.Condition, repr=False)

    def pin(self) -> bool:
        """Hold the region alive for one socket call; False when it was deregistered."""
        with self.cond:
            if not self.live:
                return False
            self.pins += 1
            return True

    def unpin(self) -> None:
        with self.cond:
            self.pins -= 1
            if not self.pins and not self.live:
                self.cond.notify_all()

    def kill(self) -> None:
        """Mark dead, then wait until no socket call touches the buffer any more."""
        with self.cond:
            self.live = False
            while self.pins:
                self.cond.wait()


def address_of(view: memoryview) -> int:
    """The buffer's real address (the ctypes object, and its export, are dropped at once)."""
    return ctypes.addressof((ctypes.c_char * 0).from_buffer(view))


class RegionTable:
    """The backend's regions by lkey and by rkey. Lookups are lock-free dict reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.by_lkey: dict[int, TcpRegion] = {}
        self.by_rkey: dict[int, TcpRegion] = {}
        self._used: set[int] = set()  # keys are never reused, so a stale key never hits a new region

    def _new_key(self) -> int:
        while True:
            key = secrets.randbits(32)
            if key and key not in self._used:
                self._used.add(key)
                return key

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
            self.by_rkey[region.rkey] = region
        return region

    def deregister(self, region: MemoryRegion) -> None:
        """Forget the keys, then wait for in-progress socket calls on the buffer. Idempotent."""
        with self._lock:
            found = self.by_lkey.get(region.lkey)
            if found is not region:
                return
            del self.by_lkey[region.lkey]
            del self.by_rkey[region.rkey]
        found.kill()

    def clear(self) -> None:
        with self._lock:
            regions = list(self.by_lkey.values())
            self.by_lkey.clear()
            self.by_rkey.clear()
        for region in regions:
            region.kill()

    def check_remote(self, opcode: int, rkey: int, addr: int, length: int) -> TcpRegion | VendorErr:
        """The target's checks; success gives the region, already pinned (``addr`` is inside it)."""
        region = self.by_rkey.get(rkey)
        if region is None:
            return VendorErr.UNKNOWN_RKEY
        offset = addr - region.addr
        if offset < 0 or offset + length > region.length:
            return VendorErr.REMOTE_OUT_OF_BOUNDS
        if not (region.can_remote_write if opcode == Opcode.RDMA_WRITE else region.can_remote_read):
            return VendorErr.REMOTE_NO_ACCESS
        if not region.pin():
            return VendorErr.REMOTE_DEREGISTERED
        return region

    def check_local(self, lkey: int, addr: int, length: int, write: bool) -> TcpRegion | VendorErr:
        """The initiator's checks for one SGE (``write``: the NIC writes it, as a READ does). Pins nothing."""
        region = self.by_lkey.get(lkey)
        if region is None or not region.live:
            return VendorErr.UNKNOWN_LKEY
        offset = addr - region.addr
        if offset < 0 or length < 0 or offset + length > region.length:
            return VendorErr.LOCAL_OUT_OF_BOUNDS
        if write and not region.can_local_write:
            return VendorErr.LOCAL_NO_ACCESS
        return region
