"""What peers did wrong on one backend's data plane: counted for ``describe()``, logged without flooding.

The reactor's thread serving accepted connections (their hellos and their
chunks) reports here: a hello that was not one (bad magic, version, or too slow: the
per-message deadline), a token nobody waits for (guessed, replayed, or for a
pair closed meanwhile), connections in their hello closed to make room,
requests the target's checks refused, and receives aborted by a
deregistration. Every line goes through a ``RateLimitedLog`` keyed on the
remote address (or the pair), so a peer that guesses tokens or rkeys in a
loop costs a line per interval, never a flood; the counters are plain
integers under one lock. Refused requests are also handed to the listener
the engine set (``TcpBackend.watch_access_errors``), which counts them per
peer.

Every lines's limiter also has a budget for all addresses together (one
"N more suppressed" line past it), so rotating addresses does not flood
either. An unknown token and a refused remote access are failed guesses:
each is charged to its source's ``FailureBudget`` (``core.budget``), and a
source over budget has each new connection wait before its hello is read
(``delayed``) until its lockout ends.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ...core.budget import GuessGuard
from ..described import DataPlaneCounts

__all__ = ["DataGuard"]

log = logging.getLogger("moriio_async.tcp")


_COUNTED = (
    "refused_tokens", "bad_messages", "slow_messages", "refused_connections", "access_errors", "aborted_requests",
    "evicted_hellos",
)  # fmt: skip
"""The ``DataPlaneCounts`` the guard counts itself (the rest are its limiter's and its budget's)."""


class DataGuard(GuessGuard):
    """Counters and rate-limited lines for one backend's data plane (thread-safe). ``budget``: failed
    guesses per source (tokens, remote accesses); the listener asks it at accept."""

    def __init__(
        self, logger: logging.Logger = log, *, interval: float = 10.0, max_failures: int = 16, lockout: float = 30.0
    ) -> None:
        super().__init__(logger, interval=interval, max_failures=max_failures, lockout=lockout)
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(_COUNTED, 0)
        self.listener: Callable[[int, str], None] | None = None

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def refused_token(self, host: str) -> None:
        """A hello whose token no pair waits for: guessed, replayed, or for a pair closed meanwhile."""
        self._count("refused_tokens")
        self.warn.log(f"token:{host}", "tcp data port: refused a connection from %s: unknown or used token", host)
        self._charge(host)

    def _charge(self, host: str) -> None:
        if self.charge(host):
            self.warn.log(
                f"lockout:{host}", "tcp data port: %s is over its budget of failed guesses: its connections wait",
                host,
            )  # fmt: skip

    def delayed(self, host: str) -> bool:
        """A connection from ``host`` arrived while its source is over its budget: it waits (counted)."""
        return self.waits(host, "tcp data port: a connection from %s waits: too many failed guesses")

    def evicted_hello(self, host: str) -> None:
        """A connection still in its hello was closed to make room for a newer one."""
        self._count("evicted_hellos")
        log.debug("tcp data port: closed a connection from %s still in its hello to make room", host)

    def bad_message(self, host: str, why: str) -> None:
        """A hello or chunk that is not one: bad magic or version, an unknown opcode, a bad count."""
        self._count("bad_messages")
        self.warn.log(f"hello:{host}", "tcp data port: bad message from %s: %s", host, why)

    def slow_message(self, where: str, why: str) -> None:
        """A hello or a chunk not complete within its deadline (a trickling peer): its connection ends."""
        self._count("slow_messages")
        self.warn.log(f"slow:{where}", "tcp data port: %s: %s; connection closed", where, why)

    def access_error(self, qp_num: int, host: str, detail: str, *, guess: bool = True) -> None:
        """The target's checks refused a request on answering pair ``qp_num``, from ``host``; ``guess``:
        charged to its source's budget (not for a region deregistered under it: that is the target's doing)."""
        self._count("access_errors")
        self.warn.log(f"access:{host}", "tcp qp %d (%s): remote access refused: %s", qp_num, host, detail)
        if guess:
            self._charge(host)
        listener = self.listener
        if listener is not None:
            listener(qp_num, detail)

    def aborted_receive(self, qp_num: int) -> None:
        """A peer's request into a region was cut short because the region was deregistered."""
        self._count("aborted_requests")
        log.debug("tcp qp %d: a request into a region being deregistered was aborted", qp_num)

    def snapshot(self) -> DataPlaneCounts:
        with self._lock:
            counts = dict(self._counts)
        return DataPlaneCounts(
            **counts,
            suppressed_log_lines=self.warn.suppressed,
            lockouts=self.budget.lockouts,
            delayed=self.budget.delayed,
        )
