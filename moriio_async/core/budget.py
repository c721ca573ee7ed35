"""What a guesser may get wrong: a per-source budget of failures, then a lockout.

A failed guess (a proof, a data-plane token, an rkey the target refused) is
charged to its source (``source_of``: the remote address, an IPv6 one by its
/64, which one attacker holds whole). ``max_failures`` of them within
``lockout`` seconds put the source over its budget for ``lockout`` seconds:
each of its new connections is then served only after a delay (a timer on
the event loop, a wait on the connection's own thread on the data port;
never a sleep on the loop), so every further guess costs the guesser that
long, and what it can try at once is bounded by the per-address caps on
connections in their hello. Delayed, not refused: an honest peer behind the
same address (every local process is 127.0.0.1) still gets in, a moment
later. An honest peer that makes a mistake now and then stays far below the
budget, and a success never costs anything.

Sources are bounded (``max_sources``, least recently charged dropped), so
the table cannot be grown by rotating addresses; a locked source is never
the one dropped while another is unlocked. Thread-safe: the TCP backend's
threads and the event loop each hold one.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from .ratelog import RateLimitedLog

__all__ = ["FailureBudget", "GuessGuard", "source_of"]


def source_of(host: str) -> str:
    """The source a remote address is charged as: an IPv4 address itself, an IPv6 one's /64."""
    try:
        address = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        if not address.is_loopback:
            return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


@dataclass(slots=True)
class _Record:
    window_start: float
    failures: int = 0
    locked_until: float = 0.0


class FailureBudget:
    """``fail(source)`` charges one failure; ``locked(source)`` says whether it is over its budget now."""

    def __init__(
        self,
        max_failures: int,
        lockout: float,
        *,
        max_sources: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_failures = max_failures
        """Failures one source may cause within ``lockout`` seconds; the one that reaches it locks the source."""
        self.lockout = lockout
        """Seconds: the window failures are counted over, and how long a source that reached
        ``max_failures`` stays locked."""
        self._max_sources = max_sources
        self._clock = clock
        self._lock = threading.Lock()
        self._sources: OrderedDict[str, _Record] = OrderedDict()
        self.failures = 0
        """Failures charged so far (all sources)."""
        self.lockouts = 0
        """Times a source went over its budget."""
        self.delayed = 0
        """Connections delayed because their source was over its budget."""

    @property
    def tracked_sources(self) -> int:
        return len(self._sources)

    def fail(self, source: str) -> bool:
        """Charge one failure to ``source``; True if it is over its budget (just now, or already)."""
        now = self._clock()
        with self._lock:
            self.failures += 1
            record = self._sources.pop(source, None)
            if record is None or now - record.window_start >= self.lockout:
                locked_until = record.locked_until if record is not None else 0.0
                record = _Record(now, locked_until=locked_until)
            self._sources[source] = record  # the most recently charged goes last
            record.failures += 1
            if record.failures >= self.max_failures and record.locked_until <= now:
                record.locked_until = now + self.lockout
                record.failures = 0
                record.window_start = now
                self.lockouts += 1
            self._trim(now)
            return record.locked_until > now

    def locked(self, source: str) -> bool:
        """``source`` is over its budget now (each True is counted in ``delayed``: call it once per connection)."""
        now = self._clock()
        with self._lock:
            record = self._sources.get(source)
            if record is None or record.locked_until <= now:
                return False
            self.delayed += 1
            return True

    def _trim(self, now: float) -> None:
        while len(self._sources) > self._max_sources:
            # The least recently charged unlocked source goes; if every one is locked, the oldest does.
            victim = next((k for k, r in self._sources.items() if r.locked_until <= now), None)
            if victim is None:
                victim = next(iter(self._sources))
            del self._sources[victim]


class GuessGuard:
    """What the control plane's guard and a TCP data port's share: WARNING lines rate-limited per key
    (``warn``), and the ``budget`` of failed guesses whose sources' connections wait while over it."""

    def __init__(self, logger: logging.Logger, *, interval: float, max_failures: int, lockout: float) -> None:
        self.warn = RateLimitedLog(logger, logging.WARNING, interval=interval)
        self.budget = FailureBudget(max_failures, lockout)

    def charge(self, host: str) -> bool:
        """One failed guess from ``host``; True if its source is over its budget (just now, or already)."""
        return self.budget.fail(source_of(host))

    def waits(self, host: str, line: str) -> bool:
        """Whether a new connection from ``host`` waits (its source is over its budget; counted): then
        ``line`` (a format with one ``%s``, the host) is logged, rate-limited per host."""
        if not self.budget.locked(source_of(host)):
            return False
        self.warn.log(f"delayed:{host}", line, host)
        return True
