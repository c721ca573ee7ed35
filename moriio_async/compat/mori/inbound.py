"""Target-side completion status (``pop_inbound_transfer_status``), built on notifications.

THE SEAM (to move into the engine later): MoRI-IO's initiator posts a small
SEND after each transfer's data on the same queue pairs, and the target's
completion thread counts them per (initiator key, uid). Here the initiator's
compat engine sends ``engine.notify(target_key, INBOUND_PREFIX + uid)`` once
the transfer succeeded (notifications arrive in order after data the
initiator saw complete), and the target's compat engine, which reads every
notification of its engine, files those in an ``InboundTable`` and passes
the rest on to ``IOEngine.recv_notification``. A user's own notification
may not start with ``INBOUND_PREFIX`` (``notify`` refuses it).

Only successes are announced, as in MoRI-IO, where a failed transfer's SEND
is flushed with it. The table holds at most ``limit`` entries (oldest dropped,
logged): a peer cannot make the target allocate without bound.
"""

from __future__ import annotations

import logging
import struct
import threading
from collections import OrderedDict

__all__ = ["INBOUND_PREFIX", "InboundTable", "decode_inbound", "encode_inbound"]

log = logging.getLogger("moriio_async")

INBOUND_PREFIX = b"\x00moriio-compat:inbound\x00"
_UID = struct.Struct(">Q")


def encode_inbound(uid: int) -> bytes:
    return INBOUND_PREFIX + _UID.pack(uid & ((1 << 64) - 1))


def decode_inbound(data: bytes) -> int | None:
    """The uid of an inbound-status message, or None for anything else."""
    if len(data) != len(INBOUND_PREFIX) + _UID.size or not data.startswith(INBOUND_PREFIX):
        return None
    uid: int = _UID.unpack_from(data, len(INBOUND_PREFIX))[0]
    return uid


class InboundTable:
    """(initiator key, uid) pairs announced as finished, popped by the target. Thread-safe."""

    def __init__(self, limit: int = 1 << 16) -> None:
        self._lock = threading.Lock()
        self._done: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._limit = limit

    def add(self, peer: str, uid: int) -> None:
        with self._lock:
            self._done[(peer, uid)] = None
            if len(self._done) > self._limit:
                dropped, _ = self._done.popitem(last=False)
                log.warning("inbound status table full (%d): dropped %s uid %d", self._limit, *dropped)

    def pop(self, peer: str, uid: int) -> bool:
        """True once per announced transfer (MoRI-IO leaves the entry; popping removes it here)."""
        with self._lock:
            return self._done.pop((peer, uid), False) is None

    def __len__(self) -> int:
        with self._lock:
            return len(self._done)
