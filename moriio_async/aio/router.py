"""The completion path of one engine: reader, qp_num -> channel table, transfer ids, outstanding set, drain.

Completions come back from the backend by queue-pair number; the router
hands each batch to the channel that owns the pair, and the channel to the
transfers. Sessions register their channel here (``attach``/``detach``) and
each transfer once (``track``); a transfer holds the router only as something
it can ``drain()``, so the deadline wait can look at the completion queue one
last time before it calls anything a timeout.

An engine with several backends has one completion queue per backend, each
with its own reader (``add_queue``). Queue-pair numbers repeat across
backends, so the ``n``-th backend numbers its pairs with ``n`` above the low
``TAG_SHIFT`` bits (``BackendOptions.qp_tag``), and each queue's completions
are looked up in that queue's own table by the number's low bits.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from ..backends.base import QP_MASK, TAG_SHIFT, CompletionQueue
from ..status import Opcode
from ..work import WorkCompletion
from .channel import QpChannel
from .cq_reader import CompletionReader, ReaderStatistics
from .transfer import Transfer

__all__ = ["TAG_SHIFT", "CompletionRouter", "Pinned", "RouterStatistics"]


class Pinned(Protocol):
    """What a transfer keeps alive while it runs (a registered region): released once it ends."""

    def unpin(self) -> None: ...


@dataclass(frozen=True, slots=True)
class RouterStatistics:
    channels: int
    """Queue pairs whose completions are routed (one per open session)."""
    outstanding: int
    """Transfers started and not yet ended."""
    drains: int
    """Explicit ``drain()`` calls (the deadline wait, aborts), beside the reader's own wakeups."""
    reader: ReaderStatistics


class CompletionRouter:
    """Routes one completion queue's completions to channels, and keeps the engine's transfer books."""

    def __init__(self, loop: asyncio.AbstractEventLoop, cq: CompletionQueue, *, batch: int = 64) -> None:
        self.loop = loop
        self._batch = batch
        self._tables: list[dict[int, QpChannel]] = []
        """Per completion queue: the backend's queue-pair number -> channel."""
        # transfer -> what it pins; one bound method ends them all (no closure per transfer).
        self._outstanding: dict[Transfer, Pinned] = {}
        self._on_ended = self._ended
        self._ids = itertools.count(1)
        self._drains = 0
        self.closed = False
        """True once the engine began to close: no new transfer may start (completions still flow).
        (An attribute, not a property: every transfer reads it.)"""
        self._stopped = False
        self._started = False
        self._readers: list[CompletionReader] = []
        self.add_queue(cq)

    def add_queue(self, cq: CompletionQueue) -> None:
        """Route another backend's queue too: its pairs are numbered with its position (1, 2, ...) above
        ``TAG_SHIFT``. Before ``start``."""
        if self._started:
            raise RuntimeError("add_queue after start")
        table: dict[int, QpChannel] = {}
        self._tables.append(table)

        def dispatch(wcs: list[WorkCompletion]) -> None:
            self._dispatch(table, wcs)

        reader = CompletionReader(self.loop, cq, dispatch, batch=self._batch, has_work=self._has_work)
        self._readers.append(reader)

    def start(self) -> None:
        """Start watching the completion queues (once)."""
        self._started = True
        for reader in self._readers:
            reader.start()

    def begin_close(self) -> None:
        """Refuse new transfers from now on; completions still reach the ones in flight until ``close``."""
        self.closed = True

    def close(self) -> None:
        """Dispatch what is already queued, then stop watching. The queue itself belongs to the caller."""
        self.closed = True
        if not self._stopped:
            for reader in self._readers:
                reader.drain()
                reader.close()
            self._stopped = True

    # -- channels -------------------------------------------------------------------------------

    def attach(self, channel: QpChannel) -> None:
        """Route the completions of ``channel``'s current queue pair to it."""
        qp_num = channel.qp_num
        self._tables[qp_num >> TAG_SHIFT][qp_num & QP_MASK] = channel

    def detach(self, channel: QpChannel) -> None:
        """Stop routing to ``channel`` (before its queue pair is closed or replaced)."""
        qp_num = channel.qp_num
        table = self._tables[qp_num >> TAG_SHIFT]
        if table.get(qp_num & QP_MASK) is channel:
            del table[qp_num & QP_MASK]

    def kick(self) -> None:
        """Work was posted (the readers' timer fallback needs to know)."""
        for reader in self._readers:
            reader.kick()

    def post_hook(self) -> Callable[[], None] | None:
        """What a channel calls after it posts: ``kick`` while some reader polls on a timer (or has not
        started), None when every reader is woken by its completion channel (then a post needs nothing)."""
        return self.kick if any(r.polls_by_timer for r in self._readers) else None

    def _dispatch(self, channels: dict[int, QpChannel], wcs: list[WorkCompletion]) -> None:
        # Every completion of the poll is accounted first, then each channel posts once: the slots
        # freed by the whole poll go out as one chunk per channel, not one small chunk per completion.
        touched: list[QpChannel] = []
        last: QpChannel | None = None
        for wc in wcs:
            channel = channels.get(wc.qp_num & QP_MASK)  # low bits: verbs completes under the device's number
            if channel is not None:
                channel.account(wc)
                if channel is not last:
                    last = channel
                    if channel not in touched:
                        touched.append(channel)
        for channel in touched:
            channel.resume()

    def drain(self) -> int:
        """Dispatch every completion already in the queue now; how many there were (0 once closed)."""
        if self._stopped:
            return 0  # the queue may be gone already; whatever was in it was dispatched by close()
        self._drains += 1
        return sum(reader.drain() for reader in self._readers)

    # -- transfers ------------------------------------------------------------------------------

    def next_transfer_id(self) -> int:
        return next(self._ids)

    def open(
        self,
        opcode: Opcode,
        peer: str,
        lo: Sequence[int] | npt.NDArray[np.int64],
        ro: Sequence[int] | npt.NDArray[np.int64],
        sz: Sequence[int] | npt.NDArray[np.int64],
        pinned: Pinned,
        uid: int | None,
    ) -> Transfer:
        """A new transfer with the next id, draining through this router, already tracked (``track``)."""
        # Positional: keyword arguments cost a few hundred instructions more per transfer.
        transfer = Transfer(self.loop, next(self._ids), opcode, peer, lo, ro, sz, self, uid, self._on_ended)
        self._outstanding[transfer] = pinned
        return transfer

    def track(self, transfer: Transfer, pinned: Pinned) -> None:
        """Count ``transfer`` as outstanding until it ends; then release ``pinned``."""
        self._outstanding[transfer] = pinned
        transfer.add_done_callback(self._on_ended)

    def _ended(self, transfer: Transfer) -> None:
        pinned = self._outstanding.pop(transfer, None)
        if pinned is not None:
            pinned.unpin()

    @property
    def outstanding(self) -> int:
        """Transfers started and not yet ended, timed-out ones included."""
        return len(self._outstanding)

    def outstanding_transfers(self) -> list[Transfer]:
        return list(self._outstanding)

    def _has_work(self) -> bool:
        return bool(self._outstanding)

    def statistics(self) -> RouterStatistics:
        stats = [reader.statistics() for reader in self._readers]
        reader = ReaderStatistics(
            sum(r.wakeups for r in stats),
            sum(r.completions for r in stats),
            max(r.largest_batch for r in stats),
            any(r.fallback_polling for r in stats),
        )
        return RouterStatistics(sum(map(len, self._tables)), len(self._outstanding), self._drains, reader)
