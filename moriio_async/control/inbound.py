"""Target-side transfer status: what initiators said about their transfers into (or out of) this engine.

MoRI-IO's ``pop_inbound_transfer_status(remote_key, uid)``. There, the
initiator posts a small SEND on each queue pair after a transfer's data, and
the target's completion thread counts them per (initiator key, uid); the
entry answers SUCCESS once every queue pair's SEND arrived and is never
removed; a failed transfer's SEND is flushed with it, so failures are never
heard of. Here, the initiator sends one ``done`` notice on its control link
once a transfer it gave a uid has ended, success or failure, and the target
files ``(uid, code)`` under the initiator's key.

``pop`` returns an entry once and removes it. Entries are bounded twice:
per initiator (``max_per_peer``: when an initiator has that many nobody
popped, its own oldest is dropped), and in bytes across all initiators
(``max_bytes``: beyond it the oldest entry of any initiator is dropped), so
many initiators, or anyone able to say hello under fresh keys, cannot make
the target hold more than ``max_bytes``. Both drops are counted (``dropped``,
``dropped_for_bytes`` of it) and logged at a halving rate. Dropping rather
than pushing back keeps a target that never pops from stalling the
initiator's control link, which also carries its queue-pair closes and
notifications. An initiator that restarts starts its uids afresh, so its
entries are dropped when its new incarnation says hello (``forget``).

The bytes are accounted, not measured: ``ENTRY_BYTES`` an entry and
``PEER_BYTES`` plus its key's size an initiator with entries, each above
what CPython allocates for them (tracemalloc, hash tables at their emptiest
after a resize included; ``tests/engine/test_inbound_bytes.py`` checks it).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from collections import OrderedDict
from typing import Final

from ..errors import InvalidArgument
from ..status import StatusCode

__all__ = ["ENTRY_BYTES", "PEER_BYTES", "InboundStatuses"]

log = logging.getLogger("moriio_async")

_TERMINAL = frozenset(c for c in StatusCode if c is StatusCode.SUCCESS or c > 10)
ENTRY_BYTES: Final = 320
"""Accounted for one entry: its uid, its (key, uid) tuple, and a slot in two ordered dicts (measured: 210-290)."""
PEER_BYTES: Final = 640
"""Accounted for an initiator with entries, besides its key's ``sys.getsizeof``: its record and ordered dict."""


class _Peer:
    """One initiator's entries, oldest first, and the key object every entry of it shares."""

    __slots__ = ("entries", "key")

    def __init__(self, key: str) -> None:
        self.key = key
        self.entries: OrderedDict[int, StatusCode] = OrderedDict()


class InboundStatuses:
    """(initiator key, uid) -> the code its transfer ended with; bounded per initiator and in bytes.

    ``record`` and ``wait`` run on the engine's loop; ``pop`` is safe from any thread.
    """

    def __init__(self, max_per_peer: int, max_bytes: int = 8 << 20) -> None:
        self.max_per_peer = max_per_peer
        self.max_bytes = max_bytes
        self.dropped = 0
        """Entries dropped unpopped: their initiator had ``max_per_peer`` newer ones, or all entries
        together were over ``max_bytes``."""
        self.dropped_for_bytes = 0
        """The part of ``dropped`` that went because of ``max_bytes`` (the oldest of all initiators)."""
        self.bytes = 0
        """Accounted bytes held now (``ENTRY_BYTES`` an entry, ``PEER_BYTES`` + key an initiator); at most
        ``max_bytes`` whenever ``record`` has returned."""
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._order: OrderedDict[tuple[str, int], None] = OrderedDict()  # every entry, oldest first
        self._waiters: dict[tuple[str, int], asyncio.Future[StatusCode]] = {}

    def record(self, peer: str, uid: int, code: int) -> bool:
        """File ``peer``'s transfer ``uid`` as ended with ``code``; False (nothing filed) for a code
        that is not a terminal status."""
        try:
            status = StatusCode(code)
        except ValueError:
            return False
        if status not in _TERMINAL:
            return False
        waiter = self._waiters.pop((peer, uid), None)
        if waiter is not None and not waiter.done():
            waiter.set_result(status)  # taken by the waiter: popped already
            return True
        with self._lock:
            p = self._peers.get(peer)
            if p is None:
                p = self._peers[peer] = _Peer(peer)
                self.bytes += PEER_BYTES + sys.getsizeof(peer)
            if uid in p.entries:  # refiled: its age starts again
                p.entries.move_to_end(uid)
                self._order.move_to_end((p.key, uid))
            else:
                self.bytes += ENTRY_BYTES
                self._order[(p.key, uid)] = None
            p.entries[uid] = status
            gone: list[tuple[str, int]] = []
            if len(p.entries) > self.max_per_peer:
                gone.append((p.key, next(iter(p.entries))))
                self._remove_locked(*gone[-1])
            over = 0
            while self.bytes > self.max_bytes and self._order:
                gone.append(next(iter(self._order)))
                self._remove_locked(*gone[-1])
                over += 1
            before = self.dropped
            self.dropped += len(gone)
            self.dropped_for_bytes += over
            dropped = self.dropped
        if dropped.bit_length() > before.bit_length():
            # Past the 1st, 2nd, 4th, 8th... drop: a target that never pops logs little.
            who, old = gone[-1]
            log.warning(
                "inbound status of %.64s uid %d dropped unpopped (%d dropped so far, %d for the byte bound): at most "
                "%d are kept per initiator (max_inbound_statuses) and %d bytes in all (max_inbound_status_bytes); "
                "pop_inbound_transfer_status takes them",
                who, old, dropped, self.dropped_for_bytes, self.max_per_peer, self.max_bytes,
            )  # fmt: skip
        return True

    def _remove_locked(self, peer: str, uid: int) -> StatusCode | None:
        """Remove one entry (and its initiator's record once empty), giving back its bytes."""
        p = self._peers.get(peer)
        if p is None:
            return None
        code = p.entries.pop(uid, None)
        if code is None:
            return None
        del self._order[(p.key, uid)]
        self.bytes -= ENTRY_BYTES
        if not p.entries:
            del self._peers[peer]
            self.bytes -= PEER_BYTES + sys.getsizeof(p.key)
        return code

    def pop(self, peer: str, uid: int) -> StatusCode | None:
        """The code ``peer``'s transfer ``uid`` ended with, once; None if not (or no longer) known."""
        with self._lock:
            return self._remove_locked(peer, uid)

    async def wait(self, peer: str, uid: int) -> StatusCode:
        """Pop the entry, waiting for it to arrive if it has not; one waiter per (peer, uid)."""
        code = self.pop(peer, uid)
        if code is not None:
            return code
        key = (peer, uid)
        if key in self._waiters:
            raise InvalidArgument(f"another task already waits for {peer!r}'s transfer uid {uid}")
        fut: asyncio.Future[StatusCode] = asyncio.get_running_loop().create_future()
        self._waiters[key] = fut
        try:
            return await fut
        finally:
            if self._waiters.get(key) is fut:
                del self._waiters[key]

    def fail_waiters(self, error: BaseException) -> None:
        """End every ``wait`` with ``error`` (the engine closes: no notice will come)."""
        waiters, self._waiters = self._waiters, {}
        for fut in waiters.values():
            if not fut.done():
                fut.set_exception(error)

    def forget(self, peer: str) -> None:
        """Drop ``peer``'s entries (it restarted: its uids start afresh)."""
        with self._lock:
            p = self._peers.get(peer)
            for uid in list(p.entries) if p is not None else ():
                self._remove_locked(peer, uid)

    def __len__(self) -> int:
        with self._lock:
            return len(self._order)
