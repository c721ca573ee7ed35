"""The registry keeps equal registrations apart (rxe gives every region without remote access rkey 0)."""

from __future__ import annotations

from typing import cast

import pytest

from moriio_async import Access, InvalidArgument
from moriio_async.backends.base import Backend, MemoryRegion
from moriio_async.engine.memory import MemoryRegistry


class RxeLikeKeys:
    """Registers like rxe: a fresh lkey per registration, rkey 0 unless remote access was asked for."""

    def __init__(self) -> None:
        self.live: list[MemoryRegion] = []
        self.exported: list[MemoryRegion] = []
        self.next_key = 0x100

    def register_memory(self, buffer: memoryview, access: Access) -> MemoryRegion:
        self.next_key += 1
        remote = bool(access & (Access.REMOTE_READ | Access.REMOTE_WRITE))
        view = memoryview(buffer)
        addr = id(buffer)  # any stable number: equal buffers give equal addresses
        mr = MemoryRegion(addr, view.nbytes, self.next_key, self.next_key if remote else 0, access, view)
        self.live.append(mr)
        return mr

    def deregister_memory(self, region: MemoryRegion) -> None:
        self.live.remove(region)  # ValueError if deregistered twice

    def export_memory(self, region: MemoryRegion) -> None:
        self.exported.append(region)


def test_equal_descriptors_are_two_registrations_each_deregistered_once() -> None:
    nic = RxeLikeKeys()
    backend = cast(Backend, nic)
    registry = MemoryRegistry("b", 1)
    buf = bytearray(64)
    first = registry.register(backend, buf, "", Access.LOCAL_WRITE)
    second = registry.register(backend, buf, "", Access.LOCAL_WRITE)
    assert first == second and len(registry) == 2 and len(nic.live) == 2

    pinned = registry.lookup(first)
    pinned.pin()
    idle = registry.lookup(second)
    assert idle is not pinned, "of equal registrations, the one no transfer uses is chosen"
    registry.deregister(idle, backend)
    assert len(registry) == 1 and nic.live == [pinned.mr]
    registry.deregister(idle, backend)  # a racing second release of the same registration does nothing
    assert len(registry) == 1 and nic.live == [pinned.mr]

    assert registry.lookup(first) is pinned
    pinned.unpin()
    registry.deregister(registry.lookup(first), backend)
    assert len(registry) == 0 and nic.live == []
    with pytest.raises(InvalidArgument, match="not a live registration"):
        registry.lookup(first)


def test_remote_regions_stay_distinct_and_only_named_ones_are_exported() -> None:
    nic = RxeLikeKeys()
    backend = cast(Backend, nic)
    registry = MemoryRegistry("b", 1)
    buf = bytearray(64)
    a = registry.register(backend, buf, "kv", Access.all())
    b = registry.register(backend, buf, "", Access.all())
    assert a != b and a.rkey != b.rkey
    assert registry.exported() == [a]
    assert [mr.rkey for mr in nic.exported] == [a.rkey], "only the named region is exported to the backend"
    c = registry.register(backend, buf, "", Access.all(), export=True)
    hidden = registry.register(backend, buf, "hidden", Access.all(), export=False)
    registry.export(backend, b)
    assert [mr.rkey for mr in nic.exported] == [a.rkey, c.rkey, b.rkey]
    assert hidden.rkey not in [mr.rkey for mr in nic.exported]
    assert registry.exported() == [a], "a named region kept local is not listed to peers either"
    with pytest.raises(InvalidArgument, match="already registered"):
        registry.register(backend, buf, "kv", Access.all())
    registry.export(backend, hidden)  # a named region exported later is listed to peers from then on
    assert registry.exported() == [a, hidden]
    assert nic.exported[-1].rkey == hidden.rkey
