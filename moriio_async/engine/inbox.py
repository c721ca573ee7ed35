"""Notifications from peers, queued in arrival order until the application takes them."""

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
    """A FIFO of notifications with any number of waiting readers, closed with its engine.

    After ``close`` what is already queued can still be taken; then ``get``
    raises ``EngineClosed`` and iteration ends, for readers waiting at the
    time of the close too.
    """

    def __init__(self) -> None:
        self._items: deque[Notification] = deque()
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.closed = False

    def __len__(self) -> int:
        return len(self._items)

    def put(self, note: Notification) -> None:
        if self.closed:
            return  # the engine closed while the frame was read: nobody can take it any more
        self._items.append(note)
        self._wake_one()

    async def get(self) -> Notification:
        while not self._items:
            if self.closed:
                raise EngineClosed("the engine closed: no more notifications")
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            except asyncio.CancelledError:
                # Taken no item, yet maybe woken for one: pass the wakeup on so it is not lost.
                if fut.done() and not fut.cancelled():
                    self._wake_one()
                raise
            finally:
                if fut in self._waiters:
                    self._waiters.remove(fut)
        return self._items.popleft()

    async def __aiter__(self) -> AsyncIterator[Notification]:
        while True:
            try:
                yield await self.get()
            except EngineClosed:
                return

    def close(self) -> None:
        self.closed = True
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)

    def _wake_one(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
