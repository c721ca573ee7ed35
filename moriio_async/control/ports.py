"""What the control plane needs of the engine's other parts, as protocols.

The peer table and the pair broker work on the engine's open transports (a
peer's queue pairs are created on them; the hello advertises them) and read
the regions it exports. Both are the engine's (``engine/transports.py``,
``engine/memory.py``), opened before the control plane starts and handed down
to it. Typed by these protocols, ``control/`` imports nothing above itself,
and the engine gets its own transport type back (``PeerTable[Transport]``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol, TypeVar

from ..backends.base import Backend, QueuePair
from ..descriptors import MemoryDesc, TransportDesc

__all__ = ["ExportedMemory", "OpenTransport", "T", "TransportSet"]


class OpenTransport(Protocol):
    """One open backend of the engine, as the control plane reads it."""

    @property
    def name(self) -> str: ...

    @property
    def backend(self) -> Backend: ...


T = TypeVar("T", bound=OpenTransport)
"""The engine's own transport type."""


class TransportSet(Protocol[T]):
    """The engine's open transports, best first (the first is ``primary``)."""

    @property
    def primary(self) -> T: ...

    @property
    def names(self) -> tuple[str, ...]: ...

    def __iter__(self) -> Iterator[T]: ...

    def get(self, name: str) -> T | None:
        """The transport called ``name`` (empty: the primary), or None if the engine has no such one."""
        ...

    def of(self, qp: QueuePair) -> T:
        """The transport a pair ``create_qp`` gave belongs to."""
        ...

    def create_qp(self, transport: T) -> QueuePair: ...

    def descs(self) -> tuple[TransportDesc, ...]: ...


class ExportedMemory(Protocol):
    """The engine's registered memory, as far as peers see it."""

    def exported(self) -> Iterable[MemoryDesc]:
        """The exported regions with a name: what peers learn at ``connect``."""
        ...
