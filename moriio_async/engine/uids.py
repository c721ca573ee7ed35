"""Transfer uids: MoRI-IO's ``TransferUniqueId``, allocated per engine and checked at every transfer call.

A uid names a transfer towards its target: when a transfer started with one
ends, the initiator tells the target (a ``done`` notice), which files the
outcome under (initiator key, uid) for ``pop_inbound_transfer_status``. So a
uid must not name two transfers at once: a call with a uid still in flight is
refused before anything is posted. ``allocate`` never hands out a uid in
flight, also when callers choose uids of their own.
"""

from __future__ import annotations

import threading

from ..errors import InvalidArgument

__all__ = ["MAX_UID", "TransferUids", "check_uid"]

MAX_UID = (1 << 64) - 1
"""Uids are unsigned 64-bit, as in MoRI-IO."""


def check_uid(uid: object) -> int:
    """``uid`` as an int in 0..2**64-1, or ``InvalidArgument``."""
    if isinstance(uid, bool) or not isinstance(uid, int):
        raise InvalidArgument(f"transfer uid must be an int, not {type(uid).__name__}")
    if not 0 <= uid <= MAX_UID:
        raise InvalidArgument(f"transfer uid {uid} is outside 0..2**64-1")
    return uid


class TransferUids:
    """The uids of one engine: a counter, and the set of uids whose transfers have not ended.

    ``allocate`` is safe from any thread (MoRI-IO code calls it from worker
    threads); ``claim`` and ``release`` run on the engine's loop.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._in_flight: set[int] = set()

    def allocate(self) -> int:
        """A uid no transfer of this engine holds now (the counter wraps at 2**64)."""
        with self._lock:
            while True:
                uid = self._next
                self._next = (uid + 1) & MAX_UID
                if uid not in self._in_flight:
                    return uid

    def claim(self, uid: object) -> int:
        """Mark ``uid`` in flight; ``InvalidArgument`` if it is not a uid or a transfer still holds it."""
        uid = check_uid(uid)
        with self._lock:
            if uid in self._in_flight:
                raise InvalidArgument(
                    f"transfer uid {uid} is still in flight",
                    hint="use engine.allocate_transfer_uid(), or wait for the transfer holding it to end",
                )
            self._in_flight.add(uid)
        return uid

    def release(self, uid: int) -> None:
        with self._lock:
            self._in_flight.discard(uid)

    def __contains__(self, uid: object) -> bool:
        return uid in self._in_flight

    def __len__(self) -> int:
        return len(self._in_flight)
