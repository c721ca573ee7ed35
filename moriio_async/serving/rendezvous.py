"""WRITE mode on the prefill side: pair each prefill request with decode's ``remote_blocks``.

The proxy sends the prefill request (HTTP) and the decode request at once;
decode then tells prefill where to write (an engine notification). Either may
arrive first. A slot is made by whichever comes first and lives at most ``ttl``
seconds: a ``remote_blocks`` nobody claims in time is handed to ``on_orphan``
(prefill answers ``write_failed``, so decode frees its blocks instead of
waiting), and a request that gave up leaves a tombstone, so a late
``remote_blocks`` is refused at once. The table is bounded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from .messages import RemoteBlocks

__all__ = ["Abandoned", "Rendezvous"]


class Abandoned(Exception):
    """The prefill request ended before decode's blocks came (or the proxy gave up on it)."""


@dataclass(eq=False)
class _Slot:
    future: asyncio.Future[RemoteBlocks]
    timer: asyncio.TimerHandle
    claimed: bool = False

    def blocks(self) -> RemoteBlocks | None:
        f = self.future
        return f.result() if f.done() and not f.cancelled() and f.exception() is None else None

    def tombstone(self, why: str) -> None:
        if not self.future.done():
            self.future.set_exception(Abandoned(why))
            self.future.exception()  # retrieved: nobody else may await it


class Rendezvous:
    """Request id -> decode's ``remote_blocks``, met from both sides, bounded in size and time."""

    def __init__(self, ttl: float, limit: int, on_orphan: Callable[[RemoteBlocks, str], None]) -> None:
        self.ttl, self.limit, self.on_orphan = ttl, limit, on_orphan
        self._slots: dict[str, _Slot] = {}

    def __len__(self) -> int:
        return len(self._slots)

    def _slot(self, request_id: str) -> _Slot | None:
        slot = self._slots.get(request_id)
        if slot is None and len(self._slots) < self.limit:
            loop = asyncio.get_running_loop()
            slot = _Slot(loop.create_future(), loop.call_later(self.ttl, self._expire, request_id))
            self._slots[request_id] = slot
        return slot

    def _expire(self, request_id: str) -> None:
        slot = self._slots.get(request_id)
        if slot is None:
            return
        blocks = slot.blocks()
        if slot.claimed and blocks is not None:
            return  # a waiting claim has them and has yet to resume: they are its own (it drops the slot)
        del self._slots[request_id]
        if blocks is not None:
            self.on_orphan(blocks, "no prefill request claimed these blocks in time")
        slot.tombstone("expired")

    def deliver(self, msg: RemoteBlocks) -> str:
        """Hand over decode's blocks; a non-empty answer is why they were refused."""
        slot = self._slot(msg.request_id)
        if slot is None:
            return "too many requests waiting for their blocks"
        if slot.future.done():
            return "duplicate remote_blocks" if slot.blocks() is not None else "the prefill request already ended"
        slot.future.set_result(msg)
        return ""

    async def claim(self, request_id: str, timeout: float) -> RemoteBlocks:
        """Decode's blocks for ``request_id``; ``Abandoned`` (and a tombstone) if none come in time."""
        slot = self._slot(request_id)
        if slot is None:
            raise Abandoned("too many requests waiting for their blocks")
        if slot.claimed:
            raise Abandoned(f"request {request_id} is already being prefilled")
        slot.claimed = True
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.shield(slot.future)
        except BaseException as exc:
            blocks = slot.blocks()
            if blocks is not None:  # they came just as we gave up: nobody will write them
                self.on_orphan(blocks, "the prefill request gave up")
            slot.tombstone("gave up")
            if isinstance(exc, TimeoutError):
                raise Abandoned(f"decode sent no remote_blocks within {timeout:g}s") from None
            raise
        finally:
            if slot.blocks() is not None:
                slot.timer.cancel()
                self._slots.pop(request_id, None)

    def abandon(self, request_id: str) -> None:
        """The request is over (the proxy gave up): a waiting claim ends, late blocks are refused."""
        slot = self._slot(request_id)
        if slot is not None:
            slot.tombstone("abandoned by the proxy")
