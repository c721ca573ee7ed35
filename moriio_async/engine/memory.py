"""Registered memory on the local side, with the pins that keep it alive while the NIC may touch it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ..backends.base import MemoryRegion
from ..descriptors import MemoryDesc
from ..errors import InvalidArgument

__all__ = ["LocalRegion", "as_region_view"]


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
    """One registration: its descriptor, the backend's region, and how many transfers use it."""

    desc: MemoryDesc
    mr: MemoryRegion
    pins: int = 0
    live: bool = True
    _idle: list[asyncio.Future[None]] = field(default_factory=list)

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
