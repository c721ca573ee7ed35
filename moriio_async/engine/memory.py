"""Registered memory on the local side, with the pins that keep it alive while the NIC may touch it."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..backends.base import Backend, MemoryRegion
from ..descriptors import MemoryDesc
from ..errors import InvalidArgument, MemoryInUse
from ..status import Access

__all__ = ["Backends", "LocalRegion", "MemoryRegistry", "as_region_view"]

Backends = Backend | Sequence[Backend]
"""The engine's open backends, best first (or its one backend): every region is registered on each."""


def _all(backends: Backends) -> Sequence[Backend]:
    return backends if isinstance(backends, Sequence) else (backends,)


def as_region_view(buffer: object) -> memoryview:
    """A writable, C-contiguous, byte-formatted view of ``buffer``, or ``InvalidArgument`` saying why not."""
    try:
        view = memoryview(buffer)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgument(
            f"{type(buffer).__name__} does not support the buffer protocol; "
            "pass a bytearray, mmap, numpy array or torch tensor's numpy() view"
        ) from None
    if view.readonly:
        raise InvalidArgument("buffer is read-only: the NIC must be able to write it (use bytearray, not bytes)")
    if not view.c_contiguous:
        raise InvalidArgument("buffer is not C-contiguous: register the contiguous base array, not a strided view")
    if view.nbytes == 0:
        raise InvalidArgument("buffer is empty")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


@dataclass(eq=False, slots=True)
class LocalRegion:
    """One registration: its descriptor, the backends' regions, and how many transfers use it."""

    desc: MemoryDesc
    mr: MemoryRegion
    """On the engine's first backend."""
    pins: int = 0
    live: bool = True
    exported: bool = False
    """Reachable by peers (``Backend.export_memory`` was called for it)."""
    more: tuple[MemoryRegion, ...] = ()
    """On the engine's other backends, in its order."""
    _idle: list[asyncio.Future[None]] = field(default_factory=list)

    def mr_for(self, tag: int) -> MemoryRegion:
        """The region on the engine's ``tag``-th backend (0: the first)."""
        return self.mr if tag == 0 else self.more[tag - 1]

    @property
    def mrs(self) -> tuple[MemoryRegion, ...]:
        return (self.mr, *self.more)

    def pin(self) -> None:
        if not self.live:
            raise InvalidArgument(f"region {self.desc.name or hex(self.desc.addr)} was deregistered")
        self.pins += 1

    def unpin(self) -> None:
        self.pins -= 1
        if self.pins == 0:
            waiters, self._idle = self._idle, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

    async def wait_unpinned(self) -> None:
        while self.pins:
            fut = asyncio.get_running_loop().create_future()
            self._idle.append(fut)
            await fut


class MemoryRegistry:
    """The engine's registered regions, and the ones it exports by name.

    Keyed by the whole descriptor, not by rkey: a region without remote access has no
    meaningful rkey (rxe gives every one of them rkey 0), so two such regions would
    collide and deregistering one would drop the other. Even the whole descriptor is not
    unique: registering the same unnamed bytes twice without remote access gives two
    equal descriptors (same address, length, rkey 0, access). Such registrations cannot
    be told apart by their owner either, so each descriptor maps to a list of them and
    one ``deregister`` removes one, the least used (see ``lookup``).
    """

    def __init__(self, key: str, incarnation: int) -> None:
        self._key = key
        self._incarnation = incarnation
        self._regions: dict[MemoryDesc, list[LocalRegion]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def register(
        self, backends: Backends, buffer: object, name: str, access: Access | None, export: bool | None = None
    ) -> MemoryDesc:
        """Register ``buffer`` on every backend; exported to peers (``Backend.export_memory``) when
        ``export``, which defaults to having a ``name``."""
        view = as_region_view(buffer)
        if name and any(desc.name == name for desc in self._regions):
            raise InvalidArgument(f"a region named {name!r} is already registered")
        access = Access.all() if access is None else Access(access)
        exported = bool(name) if export is None else export
        mrs: list[tuple[Backend, MemoryRegion]] = []
        try:
            for backend in _all(backends):
                mrs.append((backend, backend.register_memory(view, access)))
                if exported:
                    backend.export_memory(mrs[-1][1])
        except BaseException:
            for backend, done in mrs:
                backend.deregister_memory(done)
            raise
        mr = mrs[0][1]
        rkeys = {b.name: r.rkey for b, r in mrs} if len(mrs) > 1 else {}
        desc = MemoryDesc(self._key, self._incarnation, name, mr.addr, mr.length, mr.rkey, access, rkeys)
        more = tuple(r for _, r in mrs[1:])
        self._regions.setdefault(desc, []).append(LocalRegion(desc, mr, exported=exported, more=more))
        self._count += 1
        return desc

    def lookup(self, desc: MemoryDesc) -> LocalRegion:
        """The live registration ``desc`` describes (of equal ones, the least pinned), or ``InvalidArgument``."""
        regions = self._regions.get(desc)
        if not regions:
            raise InvalidArgument(f"{desc.name or 'region'} is not a live registration of engine {self._key!r}")
        return regions[0] if len(regions) == 1 else min(regions, key=lambda r: r.pins)

    def deregister(self, region: LocalRegion, backends: Backends | None) -> None:
        """Drop ``region``; a second call for the same one (a racing ``release_memory``) does nothing."""
        if not region.live:
            return
        region.live = False
        regions = self._regions[region.desc]
        regions.remove(region)
        if not regions:
            del self._regions[region.desc]
        self._count -= 1
        if backends is not None:
            for backend, mr in zip(_all(backends), region.mrs, strict=True):
                backend.deregister_memory(mr)

    def deregister_unused(self, desc: MemoryDesc, backends: Backends | None) -> None:
        """Drop the region ``desc`` names now; ``MemoryInUse`` while transfers pin it."""
        region = self.lookup(desc)
        if region.pins:
            raise MemoryInUse(
                f"{region.pins} transfer(s) still use region {desc.name or hex(desc.addr)}",
                hint="await engine.release_memory(desc) to deregister once they end, or abort their sessions first",
            )
        self.deregister(region, backends)

    def export(self, backends: Backends, desc: MemoryDesc) -> None:
        """Make every live registration ``desc`` describes reachable by peers."""
        regions = self._regions.get(desc)
        if not regions:
            raise InvalidArgument(f"{desc.name or 'region'} is not a live registration of engine {self._key!r}")
        for region in regions:
            for backend, mr in zip(_all(backends), region.mrs, strict=True):
                backend.export_memory(mr)
            region.exported = True

    def exported(self) -> list[MemoryDesc]:
        """The exported regions with a name: what peers learn at ``connect``."""
        return [desc for desc, regions in self._regions.items() if desc.name and any(r.exported for r in regions)]
