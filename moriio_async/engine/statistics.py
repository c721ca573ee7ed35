"""``EngineStatistics``: one typed, frozen snapshot of an engine, composed of its collaborators' own snapshots.

Each collaborator already counts in a frozen dataclass of its own (the
completion router with its readers, the peer table, the guard); the engine
adds what it keeps itself (sessions, regions, queued notifications, inbound
statuses) and the backends' data-plane counters. ``moriio_async.metrics``
exports the same figures to Prometheus.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from ..aio.channel import ChannelState
from ..aio.cq_reader import ReaderStatistics
from ..aio.router import RouterStatistics
from ..control.book import PeerStatistics
from ..control.guard import ControlCounters

__all__ = ["EngineStatistics", "InboundStatistics", "SessionStatistics"]

IDLE_ROUTER = RouterStatistics(0, 0, 0, ReaderStatistics(0, 0, 0, fallback_polling=False))
"""The router's figures before the engine first started."""
NO_PEERS = PeerStatistics(0, 0, 0, 0)


@dataclass(frozen=True, slots=True)
class InboundStatistics:
    """What peers sent this engine that waits to be taken: notifications and ended transfers' statuses."""

    notifications: int
    """Notifications queued for ``recv_notification``."""
    notification_bytes: int
    statuses: int
    """Ended transfers' statuses kept for ``pop_inbound_transfer_status``."""
    status_bytes: int
    """Bytes those statuses are accounted for (``max_inbound_status_bytes``)."""
    dropped: int
    """Statuses dropped unpopped (``max_inbound_statuses`` or ``max_inbound_status_bytes``)."""
    dropped_for_bytes: int
    """Of those, the ones dropped for ``max_inbound_status_bytes``."""
    done_dropped: int
    """``done`` notices this engine could not send to its peers (no link)."""


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    """``IOEngine.statistics()``: identity, counts, the reader's figures, and what peers did wrong."""

    key: str
    incarnation: int
    authenticated: bool
    """Peers must prove the shared secret in their hello."""
    transports: tuple[str, ...]
    """The open backends, best first (empty before start)."""
    peer_transports: Mapping[str, str]
    """Peer key -> the transport this engine's new sessions to it use."""
    answering_transports: Mapping[str, str]
    """Peer key -> the transport of the pairs that peer opened to this engine."""
    sessions: int
    regions: int
    uids_in_flight: int
    """Transfer uids allocated and not yet released."""
    router: RouterStatistics
    """Routed queue pairs, transfers in flight, the completion readers' figures."""
    peers: PeerStatistics
    """Known peers, links and queue pairs."""
    guard: ControlCounters
    """What peers did wrong on the control plane (refused links and hellos, bad frames, access errors)."""
    suppressed_log_lines: int
    """Warnings peers provoked that the rate limit held back."""
    inbound: InboundStatistics
    data_plane: Mapping[str, int]
    """What peers did wrong on the transports' own data ports (tcp: refused tokens, bad and slow messages,
    refused connections, aborted requests), summed over the transports that count it."""

    @property
    def outstanding(self) -> int:
        """Transfers started and not yet ended (``router.outstanding``)."""
        return self.router.outstanding

    def figures(self) -> dict[str, int]:
        """Every count, flat (booleans as 0/1), for JSON and metrics: the router's, the peer table's and
        the guard's fields under their own names (``outstanding``, ``links``, ``bad_frames``: the names the
        statistics dict had), the other groups' prefixed with the group's name (``reader_completions``,
        ``inbound_dropped``, ``data_plane_<counter>``). Identity and the per-peer tables are left out."""
        return dict(_flatten("", dataclasses.asdict(self)))


_TRANSPARENT = frozenset({"router", "peers", "guard"})
"""Groups whose fields are named alone (their names do not collide); the others prefix theirs."""
_LEFT_OUT = frozenset({"key", "incarnation", "transports", "access_errors", "peer_transports", "answering_transports"})
"""Identity, not quantities; and tables keyed by peer (a metric exports them with labels)."""


def _flatten(prefix: str, values: Mapping[str, object]) -> Iterator[tuple[str, int]]:
    for name, value in values.items():
        if name in _LEFT_OUT:
            continue
        if isinstance(value, Mapping):
            yield from _flatten(prefix if name in _TRANSPARENT else f"{prefix}{name}_", value)
        elif isinstance(value, bool | int):
            yield prefix + name, int(value)


@dataclass(frozen=True, slots=True)
class SessionStatistics:
    """``Session.statistics()``: its queue pair and what is under way on it."""

    state: ChannelState
    transport: str
    qp_num: int
    in_flight: int
    """Work requests posted and not yet completed."""
    waiting: int
    """Transfers waiting for send-queue room."""
    posted: int
    """Work requests posted since the session opened."""
    max_in_flight: int
    sq_depth: int
