"""What hostile or broken peers did to one engine: counted for ``statistics()``, logged without flooding.

Every line a peer can provoke goes through a ``RateLimitedLog`` keyed on the
remote address (one WARNING per address per interval, the next one saying
how many were held back; and a few per interval from all addresses together,
then one "N more suppressed" line), so a peer that sends a thousand bad
frames or rogue hellos, from one address or a thousand, costs a few lines,
never a traceback.

A failed proof is also charged to its source's ``FailureBudget``: past
``max_failures_per_source`` within ``failure_lockout``, each new connection
from that source waits before its hello is read (``delayed``) until the
lockout ends.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from ..core.budget import GuessGuard
from ..core.ratelog import RateLimitedLog

__all__ = ["ControlCounters", "Guard"]

log = logging.getLogger("moriio_async")

MAX_TRACKED_PEERS = 1024
"""Peers whose access errors are counted one by one (least recently hit dropped)."""


@dataclass(frozen=True, slots=True)
class ControlCounters:
    """A snapshot of the guard's counters."""

    refused_links: int
    """Connections refused at accept (the link caps)."""
    idle_closed: int
    """Links closed after ``link_idle_timeout`` carrying nothing."""
    bad_frames: int
    """Frames that were not one valid message (each closed its link)."""
    rogue_hellos: int
    """Hellos refused: a bad first frame, a key too long, a failed proof, a secret on one side only, an
    older incarnation."""
    auth_failures: int
    """Of those, the hellos whose proof failed or that disagreed about having a secret."""
    impersonations: int
    """Of those, the hellos that named an engine this one knows, and failed to prove or were older than it."""
    access_errors: dict[str, int]
    """Remote access errors per peer key (fed by the data plane)."""
    evicted_hellos: int = 0
    """Connections still in their hello closed to make room for newer ones (``max_hellos``, the link caps)."""
    lockouts: int = 0
    """Sources locked out for failing too many proofs (``max_failures_per_source``)."""
    delayed: int = 0
    """Connections whose hello was read late because their source was over its budget."""
    evicted_idle_links: int = 0
    """Idle links (hello said, carrying nothing) closed at ``max_links`` to make room for a new connection."""


class Guard(GuessGuard):
    """Counters and rate-limited lines for what peers do wrong; one per engine."""

    def __init__(
        self,
        logger: logging.Logger = log,
        *,
        interval: float = 10.0,
        max_failures: int = 16,
        lockout: float = 30.0,
    ) -> None:
        super().__init__(logger, interval=interval, max_failures=max_failures, lockout=lockout)
        self._info = RateLimitedLog(logger, logging.INFO, interval=interval)
        self.evicted_hellos = 0
        self.evicted_idle_links = 0
        self.refused_links = 0
        self.idle_closed = 0
        self.bad_frames = 0
        self.rogue_hellos = 0
        self.auth_failures = 0
        self.impersonations = 0
        self._access_errors: OrderedDict[str, int] = OrderedDict()

    @property
    def suppressed(self) -> int:
        """Lines held back by the rate limits so far."""
        return self.warn.suppressed + self._info.suppressed

    def delayed(self, host: str) -> bool:
        """``host``'s source failed too many proofs lately: its new connection waits before it is heard."""
        return self.waits(host, "control listener: a connection from %s waits: too many failed proofs from there")

    def evicted(self, count: int, *, idle: int = 0) -> None:
        """``count`` connections in their hello (and ``idle`` idle links) were closed to make room."""
        if count:
            self.evicted_hellos += count
            log.debug("control listener: closed %d connection(s) still in their hello to make room", count)
        if idle:
            self.evicted_idle_links += idle
            log.debug("control listener: closed %d idle link(s) to make room (max_links)", idle)

    def refused_link(self, host: str, why: str) -> None:
        self.refused_links += 1
        self.warn.log(f"accept:{host}", "control listener: refused a connection from %s: %s", host, why)

    def idle(self, address: str, seconds: float) -> None:
        self.idle_closed += 1
        log.debug("control link %s: idle for %gs with nothing on it; closed", address, seconds)

    def bad_frame(self, host: str, address: str, error: Exception) -> None:
        self.bad_frames += 1
        self.warn.log(f"frame:{host}", "control link %s: %s; closing it", address, error)

    def rogue_hello(
        self, host: str, address: str, why: str, *, auth: bool = False, impersonation: bool = False
    ) -> None:
        """A hello refused; ``auth``: a failed proof or a secret on one side only; ``impersonation``: it
        named an engine this one knows."""
        self.rogue_hellos += 1
        self.auth_failures += auth
        self.impersonations += impersonation
        what = "impersonation attempt" if impersonation else "authentication failed" if auth else "hello refused"
        if auth and self.charge(host):
            why = f"{why} (this source's connections now wait before they are heard: too many failed proofs)"
        self.warn.log(f"hello:{host}", "control handshake from %s: %s: %s", address, what, why)

    def dropped_notice(self, host: str, address: str, what: str, why: str) -> None:
        self._info.log(f"notice:{host}", "control link %s: %s dropped: %s", address, what, why)

    def access_error(self, peer: str, detail: str) -> None:
        """A peer's remote request was refused by the bounds checks (an unexported rkey, a bad range)."""
        self._access_errors[peer] = self._access_errors.pop(peer, 0) + 1
        if len(self._access_errors) > MAX_TRACKED_PEERS:
            self._access_errors.popitem(last=False)
        self.warn.log(f"access:{peer}", "peer %r: remote access refused: %s", peer, detail)

    def snapshot(self) -> ControlCounters:
        return ControlCounters(
            self.refused_links,
            self.idle_closed,
            self.bad_frames,
            self.rogue_hellos,
            self.auth_failures,
            self.impersonations,
            dict(self._access_errors),
            self.evicted_hellos,
            self.budget.lockouts,
            self.budget.delayed,
            self.evicted_idle_links,
        )
