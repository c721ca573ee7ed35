"""The peer book: which engines this one knows, at which incarnation, and which it was told to forget.

A peer is an engine known by key at one incarnation (from a hello, a
``connect`` or ``register_remote_engine``). A hello from another incarnation
of a known peer supersedes it: its earlier links and answering pairs are
closed, and the statuses it announced are dropped (its uids start afresh).
With a shared secret, incarnations are ordered (``descriptors.new_incarnation``):
only a newer one supersedes, an older one is refused. (Without a secret
anybody may claim any incarnation, so ordering them would only let one
hostile hello lock the real engine out.)

``deregister_remote_engine`` marks a peer forgotten: this engine opens no new
pair to it (new sessions, and reconnects of old ones, fail) and sends it no
notification until ``connect`` or ``register_remote_engine`` names it again.
Nothing else changes: sessions already open keep their pairs, transfers in
flight end as they would (and still announce their end), and the peer's own
links, requests and notices are served as before (MoRI-IO's
``DeregisterRemoteEngine`` likewise only forgets the address book entry).
Peers whose links all closed are remembered up to ``max_peers``, least
recently used dropped first, with the statuses they announced.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from ..descriptors import EngineDesc, MemoryDesc
from ..errors import StalePeer
from .inbound import InboundStatuses
from .link import ControlLink
from .links import LinkRegistry

__all__ = ["Peer", "PeerBook", "PeerInfo", "PeerStatistics"]


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """What ``connect`` learned: the peer engine and the memory it exports by name."""

    engine: EngineDesc
    memory: dict[str, MemoryDesc]


@dataclass(frozen=True, slots=True)
class PeerStatistics:
    peers: int
    """Peer engines known (not pruned yet)."""
    links: int
    """Open control links, handshakes in progress included."""
    answering_qps: int
    """Queue pairs this engine opened for peers' sessions."""
    opened_qps: int
    """Queue pairs this engine's sessions opened towards peers."""


@dataclass(eq=False, slots=True)
class Peer:
    """One known engine, at one incarnation."""

    desc: EngineDesc
    link: ControlLink | None = None
    """The link this engine sends its requests and notices on."""
    forgotten: bool = False
    """``deregister_remote_engine`` named it: no new pair to it, no notification."""


class PeerBook:
    """Known peers by key, least recently used first."""

    def __init__(
        self,
        links: LinkRegistry,
        inbound: InboundStatuses,
        *,
        busy: Callable[[], set[str]],
        authenticates: bool,
        max_peers: int,
    ) -> None:
        self._links = links
        self._inbound = inbound
        self._busy = busy
        """Keys of peers this engine holds pairs to (never pruned)."""
        self._authenticates = authenticates
        self._max_peers = max_peers
        self._peers: OrderedDict[str, Peer] = OrderedDict()

    def __len__(self) -> int:
        return len(self._peers)

    def __contains__(self, key: object) -> bool:
        return key in self._peers

    def get(self, key: str) -> Peer | None:
        return self._peers.get(key)

    def touch(self, key: str) -> None:
        """``key`` was used: it is the most recently used now."""
        self._peers.move_to_end(key)

    def learn(self, desc: EngineDesc, *, from_peer: bool) -> Peer:
        """The peer ``desc`` names, learned or updated; ``StalePeer`` for an older incarnation that an
        authenticated hello (``from_peer``) claims. Learning it from the application (``from_peer``
        false: ``connect``, ``register_remote_engine``) also undoes a deregistration."""
        peer = self._peers.get(desc.key)
        if peer is not None and peer.desc.incarnation == desc.incarnation:
            self._peers.move_to_end(desc.key)
            if desc.transports and desc.transports != peer.desc.transports:
                # What it says in its hello is what it has open (a descriptor packed elsewhere may not say).
                peer.desc = desc
            if not from_peer:
                peer.forgotten = False
            return peer
        forgotten = False
        if peer is not None:
            if from_peer and self._authenticates and desc.incarnation < peer.desc.incarnation:
                raise StalePeer(
                    f"engine {desc.key!r} is known as incarnation {peer.desc.incarnation:#x}, newer than "
                    f"{desc.incarnation:#x}: an older incarnation cannot take its place"
                )
            # The peer restarted: its earlier sessions are gone, and so are its earlier links and uids.
            self._links.close_all_answering(peer.desc)
            self._links.close_superseded(desc)
            self._inbound.forget(desc.key)
            forgotten = peer.forgotten and from_peer  # its own hello does not undo the application's choice
        peer = self._peers[desc.key] = Peer(desc, forgotten=forgotten)
        self._peers.move_to_end(desc.key)
        self.prune(keep=desc.key)
        return peer

    def forget(self, key: str) -> bool:
        """Mark ``key`` forgotten (see the module docstring); False if it is not known."""
        peer = self._peers.get(key)
        if peer is None:
            return False
        peer.forgotten = True
        return True

    def prune(self, keep: str | None = None) -> None:
        """Forget the least recently used peers with no open link and no pair, down to ``max_peers``."""
        excess = len(self._peers) - self._max_peers
        if excess <= 0:
            return
        busy = self._links.keys_with_links() | self._busy()
        for key in list(self._peers):
            if excess <= 0:
                break
            if key != keep and key not in busy:
                del self._peers[key]
                self._inbound.forget(key)  # so statuses are bounded by max_peers x max_inbound_statuses
                excess -= 1
