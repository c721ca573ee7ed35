"""Notifications from peers, queued in arrival order until the application takes them; bounded.

The queue holds at most ``max_items`` notifications and ``max_bytes`` of
their data. When it is full, ``put`` waits for room: the link reader that
called it stops reading, so the peer's TCP window fills and its ``notify()``
fails after its ``control_timeout`` (backpressure to the sender; nothing
already accepted is dropped). Readers waiting for room get it in arrival
order, one link after another.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ..errors import EngineClosed

__all__ = ["Inbox", "Notification"]


@dataclass(frozen=True, slots=True)
class Notification:
    """A small message from a peer engine (write_done, release, ...)."""

    peer: str
    data: bytes


class Inbox:
    """A bounded FIFO of notifications with any number of waiting readers, closed with its engine.

    After ``close`` what is already queued can still be taken; then ``get``
    raises ``EngineClosed`` and iteration ends, for readers waiting at the
    time of the close too. A ``put`` waiting for room at the close drops its
    notification.
    """

    def __init__(self, max_items: int = 4096, max_bytes: int = 64 << 20) -> None:
        self.max_items = max_items
        self.max_bytes = max_bytes
        self._items: deque[Notification] = deque()
        self._bytes = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._putters: deque[asyncio.Future[None]] = deque()
        self.closed = False

    def __len__(self) -> int:
        return len(self._items)

    @property
    def bytes(self) -> int:
        """Bytes of notification data queued."""
        return self._bytes

    def _full(self, size: int) -> bool:
        # An empty inbox takes any notification (the frame limit bounds its size).
        return bool(self._items) and (len(self._items) >= self.max_items or self._bytes + size > self.max_bytes)

    async def put(self, note: Notification) -> None:
        """Queue ``note``, waiting while the inbox is full (the caller's link stops reading meanwhile)."""
        while not self.closed and (self._putters or self._full(len(note.data))):
            await self._wait_turn(self._putters)
            if not self._full(len(note.data)):
                break
        if self.closed:
            return  # the engine closed while the frame was read: nobody can take it any more
        self._items.append(note)
        self._bytes += len(note.data)
        self._wake(self._waiters)

    async def get(self) -> Notification:
        while not self._items:
            if self.closed:
                raise EngineClosed("the engine closed: no more notifications")
            await self._wait_turn(self._waiters)
        note = self._items.popleft()
        self._bytes -= len(note.data)
        self._wake(self._putters)
        return note

    async def __aiter__(self) -> AsyncIterator[Notification]:
        while True:
            try:
                yield await self.get()
            except EngineClosed:
                return

    def close(self) -> None:
        self.closed = True
        for queue in (self._waiters, self._putters):
            while queue:
                fut = queue.popleft()
                if not fut.done():
                    fut.set_result(None)

    @classmethod
    async def _wait_turn(cls, queue: deque[asyncio.Future[None]]) -> None:
        """Wait in ``queue`` until ``_wake`` (or ``close``) takes this waiter."""
        fut = asyncio.get_running_loop().create_future()
        queue.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            # Woken, yet cancelled before it could use the wakeup (an item, or room): pass it on so it is not lost.
            if fut.done() and not fut.cancelled():
                cls._wake(queue)
            raise
        finally:
            if fut in queue:
                queue.remove(fut)

    @staticmethod
    def _wake(queue: deque[asyncio.Future[None]]) -> None:
        while queue:
            fut = queue.popleft()
            if not fut.done():
                fut.set_result(None)
                return
