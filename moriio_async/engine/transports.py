"""The backends one engine has open, best first (which of them each peer's sessions use: ``control/choices``).

``backend="auto"`` opens cma (peers on this host), then verbs (when a device
works), then tcp, skipping any this host cannot open; ``backends=(...)``
opens exactly those, in that order; ``backend="tcp"`` (or another name)
opens that one alone, as before transports. Each has its own completion
queue. The engine advertises them in its hello (``EngineDesc.transports``,
covered by the proofs of an authenticated hello), and a session to a peer
uses the first of this engine's transports the peer has too, with the same
scope (for cma: the same host and namespaces). The first pair opened over
cma is the probe: if the kernel refuses the attach (``CmaNotPermitted``),
that peer is demoted to the next transport, with one WARNING line.

Queue-pair numbers: the N-th transport's backend is opened with
``BackendOptions.qp_tag = N`` and numbers its pairs ``N << TAG_SHIFT | n``
itself (``backends.base.TAG_SHIFT``), so the control plane, the link books and
the completion router tell pairs of different backends apart with no wrapper
on the data path; the first transport's (the only one, for a single-backend
engine) numbers are the backend's own counts, as before transports.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace

import msgspec

from ..backends import open_backend
from ..backends.base import TAG_SHIFT, Backend, CompletionQueue, QueuePair
from ..backends.described import TcpFacts
from ..descriptors import TransportDesc
from ..errors import BackendUnavailable
from .config import IOEngineConfig

__all__ = ["Transport", "Transports", "open_backends"]

log = logging.getLogger("moriio_async")


def open_backends(config: IOEngineConfig) -> list[Backend]:
    """Open the backends ``config`` asks for, best first (blocking: run it off the loop).

    With ``auto`` a backend this host cannot open is skipped (one INFO line); an explicit
    list or a single name must open in full. On failure nothing stays open.
    """
    names = config.transport_names()
    optional = config.backend == "auto" and not config.backends
    opened: list[Backend] = []
    try:
        for i, name in enumerate(names):
            # Its place among those opened: its pairs' numbers carry it (``Transports.of``).
            options = config.backend_options(name, tag=len(opened))
            if name == "cma" and i < len(names) - 1:
                # The engine has a transport to fall back on: it says why, once, not the backend.
                options = replace(options, specific=replace(config.cma, quiet_refusal=True))
            try:
                opened.append(open_backend(name, options))
            except (BackendUnavailable, OSError) as exc:  # OSError: a socket or memfd the host refuses
                if not optional:
                    raise
                log.info("backend=auto: %s unavailable here (%s)", name, exc)
        if not opened:
            raise BackendUnavailable(f"none of the backends {list(names)} could be opened")
    except BaseException:
        for backend in opened:
            backend.close()
        raise
    return opened


@dataclass(eq=False, slots=True)
class Transport:
    """One open backend of the engine, its completion queue, and its place in the engine's order."""

    name: str
    backend: Backend
    cq: CompletionQueue
    """The one completion queue all of this backend's queue pairs complete into."""
    tag: int
    """Its place in the engine's order (0: the primary): the backend's ``qp_tag``, and the index of a local
    region's memory registration with it (``mr_for``)."""

    def desc(self) -> TransportDesc:
        return TransportDesc(self.name, self.backend.scope())


class Transports:
    """The engine's open backends in its order of preference (the first is ``primary``)."""

    def __init__(self, backends: list[Backend], cq_depth: int) -> None:
        self._list: list[Transport] = []
        try:
            for tag, backend in enumerate(backends):
                self._list.append(Transport(backend.name, backend, backend.create_cq(cq_depth), tag))
        except BaseException:
            self.close_queues()
            raise
        self._by_name = {t.name: t for t in self._list}

    def __iter__(self) -> Iterator[Transport]:
        return iter(self._list)

    def __len__(self) -> int:
        return len(self._list)

    @property
    def primary(self) -> Transport:
        return self._list[0]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self._list)

    def get(self, name: str) -> Transport | None:
        """The transport called ``name`` (empty: the primary), or None if this engine has no such one."""
        return self._list[0] if not name else self._by_name.get(name)

    def of(self, qp: QueuePair) -> Transport:
        """The transport a pair ``create_qp`` gave belongs to."""
        return self._list[qp.qp_num >> TAG_SHIFT]

    def descs(self) -> tuple[TransportDesc, ...]:
        return tuple(t.desc() for t in self._list)

    def data_plane(self) -> dict[str, int]:
        """What peers did wrong on the transports' own data ports (tcp: refused tokens, bad and slow
        messages, refused connections, aborted requests), summed over the transports that count it."""
        total: dict[str, int] = {}
        for t in self._list:
            facts = t.backend.describe()
            if isinstance(facts, TcpFacts):
                for name, n in msgspec.structs.asdict(facts.data_plane).items():
                    total[name] = total.get(name, 0) + n
        return total

    def create_qp(self, transport: Transport) -> QueuePair:
        return transport.backend.create_qp(transport.cq)

    def close_queues(self) -> None:
        for t in self._list:
            t.cq.close()
