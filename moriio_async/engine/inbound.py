"""Target-side transfer status: what initiators said about their transfers into (or out of) this engine.

MoRI-IO's ``pop_inbound_transfer_status(remote_key, uid)``. There, the
initiator posts a small SEND on each queue pair after a transfer's data, and
the target's completion thread counts them per (initiator key, uid); the
entry answers SUCCESS once every queue pair's SEND arrived and is never
removed; a failed transfer's SEND is flushed with it, so failures are never
heard of. Here, the initiator sends one ``done`` notice on its control link
once a transfer it gave a uid has ended, success or failure, and the target
files ``(uid, code)`` under the initiator's key.

``pop`` returns an entry once and removes it. Entries are bounded per
initiator (``max_per_peer``): when an initiator has that many nobody popped,
its oldest is dropped (counted in ``dropped``, and logged). Dropping rather
than pushing back keeps a target that never pops from stalling the
initiator's control link, which also carries its queue-pair closes and
notifications. An initiator that restarts starts its uids afresh, so its
entries are dropped when its new incarnation says hello (``forget``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict

from ..errors import InvalidArgument
from ..status import StatusCode

__all__ = ["InboundStatuses"]

log = logging.getLogger("moriio_async")

_TERMINAL = frozenset(c for c in StatusCode if c is StatusCode.SUCCESS or c > 10)


class InboundStatuses:
    """(initiator key, uid) -> the code its transfer ended with; bounded per initiator.

    ``record`` and ``wait`` run on the engine's loop; ``pop`` is safe from any thread.
    """

    def __init__(self, max_per_peer: int) -> None:
        self.max_per_peer = max_per_peer
        self.dropped = 0
        """Entries dropped unpopped because their initiator had ``max_per_peer`` newer ones."""
        self._lock = threading.Lock()
        self._peers: dict[str, OrderedDict[int, StatusCode]] = {}
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
            entries = self._peers.setdefault(peer, OrderedDict())
            entries[uid] = status
            entries.move_to_end(uid)
            if len(entries) <= self.max_per_peer:
                return True
            old, _ = entries.popitem(last=False)
            self.dropped += 1
            dropped = self.dropped
        if dropped & (dropped - 1) == 0:  # the 1st, 2nd, 4th, 8th... drop: a target that never pops logs little
            log.warning(
                "inbound status of %s uid %d dropped unpopped (%d dropped so far): at most %d are kept per "
                "initiator (max_inbound_statuses); pop_inbound_transfer_status takes them",
                peer, old, dropped, self.max_per_peer,
            )  # fmt: skip
        return True

    def pop(self, peer: str, uid: int) -> StatusCode | None:
        """The code ``peer``'s transfer ``uid`` ended with, once; None if not (or no longer) known."""
        with self._lock:
            entries = self._peers.get(peer)
            if entries is None:
                return None
            code = entries.pop(uid, None)
            if not entries:
                del self._peers[peer]
            return code

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
            self._peers.pop(peer, None)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(e) for e in self._peers.values())
