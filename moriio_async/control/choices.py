"""Which transport each peer's sessions use: the best both ends share, less those the kernel refused.

A session to a peer uses the first of this engine's transports that the peer
advertised in its hello with the same scope (for cma: the same host and
namespaces). The first pair opened over cma is the probe: if the kernel
refuses the attach, that peer is demoted to the next transport, with one
WARNING line. The target side remembers which transport each peer's pairs
came over. The transports themselves are the engine's (``ports``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Generic

from ..descriptors import EngineDesc
from ..errors import BackendUnavailable
from .ports import T, TransportSet

__all__ = ["PeerChoices"]

log = logging.getLogger("moriio_async")


@dataclass(slots=True)
class _Choice:
    incarnation: int
    refused: set[str] = field(default_factory=set)
    chosen: str | None = None
    answered: str | None = None
    """The transport of the last pair the peer opened to this engine (its sessions' choice)."""


class PeerChoices(Generic[T]):
    """Which transport each peer's sessions use: the best both ends share, less those the kernel refused."""

    def __init__(self, key: str, transports: TransportSet[T], *, capacity: int) -> None:
        self._key = key
        self._transports = transports
        self._capacity = capacity
        self._choices: dict[str, _Choice] = {}

    def _entry(self, peer: EngineDesc) -> _Choice:
        entry = self._choices.get(peer.key)
        if entry is None or entry.incarnation != peer.incarnation:
            entry = self._choices[peer.key] = _Choice(peer.incarnation)
            while len(self._choices) > self._capacity:
                del self._choices[next(iter(self._choices))]  # the oldest: it chooses again if it comes back
        return entry

    def _pick(self, peer: EngineDesc, entry: _Choice) -> T | None:
        # An older peer advertises no transports: its one backend, with no scope (so never cma).
        offered = {t.name: t.scope for t in peer.transports} or {peer.backend: ""}
        for t in self._transports:
            if t.name not in entry.refused and offered.get(t.name) == t.backend.scope():
                return t
        return None

    def choose(self, peer: EngineDesc) -> T:
        """The transport for new sessions to ``peer`` (logged at INFO the first time for each incarnation)."""
        entry = self._entry(peer)
        t = self._pick(peer, entry)
        if t is None:
            raise BackendUnavailable(
                f"engine {self._key!r} shares no transport with {peer.key!r}: this engine has "
                f"{list(self._transports.names)} (refused: {sorted(entry.refused) or 'none'}), "
                f"it has {list(peer.transport_names())}",
                hint="give both engines a backend in common (backend='auto' opens every one this host has)",
            )
        if entry.chosen != t.name:
            entry.chosen = t.name
            why = " (same host)" if t.name == "cma" else ""
            log.info("engine %s: sessions to %s use %s%s", self._key, peer.key, t.name, why)
        return t

    def refuse(self, peer: EngineDesc, transport: T, why: BaseException) -> bool:
        """``transport`` cannot reach ``peer`` (the kernel refused the probe): True if another may,
        after the one WARNING line that says so."""
        entry = self._entry(peer)
        entry.refused.add(transport.name)
        entry.chosen = None
        nxt = self._pick(peer, entry)
        if nxt is None:
            return False
        log.warning(
            "engine %s: %s to %s is not permitted, falling back to %s: %s",
            self._key, transport.name, peer.key, nxt.name, why,
        )  # fmt: skip
        return True

    def chosen(self) -> dict[str, str]:
        """Peer key -> the transport its sessions use (peers with a choice made)."""
        return {key: c.chosen for key, c in self._choices.items() if c.chosen is not None}

    def answered(self, peer: EngineDesc, transport: str) -> None:
        """``peer`` opened a pair to this engine over ``transport`` (the target's side of its choice)."""
        self._entry(peer).answered = transport

    def answering(self) -> dict[str, str]:
        """Peer key -> the transport of the pairs it opens to this engine (peers that opened any)."""
        return {key: c.answered for key, c in self._choices.items() if c.answered is not None}
