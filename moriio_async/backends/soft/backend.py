"""The backend every software NIC shares: its completion queues, its queue pairs and their numbers, close.

A backend's own class (tcp, cma) adds its memory and the port its peers dial,
and says what ``close`` stops besides the pairs (``_stop``, ``_forget_memory``).

Queue-pair numbers: ``BackendOptions.qp_tag << TAG_SHIFT | n``, with ``n`` a
24-bit counter of this backend, so the pairs of an engine's several backends
never share a number (the engine gives each backend its place as the tag).
"""

from __future__ import annotations

import itertools
import threading
from typing import ClassVar, Generic, TypeVar

from ...errors import EngineClosed, InvalidArgument
from ..base import QP_MASK, TAG_SHIFT, Backend, BackendOptions, CompletionQueue, QueuePair
from .cq import SoftCompletionQueue
from .qp import MAX_SEND_WR, MAX_SGE, SoftQueuePair

__all__ = ["SoftBackend"]

Q = TypeVar("Q", bound=SoftQueuePair)  # type: ignore[type-arg]


class SoftBackend(Backend, Generic[Q]):
    """Completion queues, queue pairs and the closing of a software NIC."""

    name: ClassVar[str]

    def __init__(self, options: BackendOptions) -> None:
        self.options = options
        self._lock = threading.Lock()
        self._closed = False
        self._qp_tag = options.qp_tag << TAG_SHIFT
        self._qp_numbers = itertools.count(0x10)
        self._qps: dict[int, Q] = {}
        self._cqs: list[SoftCompletionQueue] = []

    def create_cq(self, depth: int) -> CompletionQueue:
        self._check_open()
        cq = SoftCompletionQueue(depth)
        with self._lock:
            self._cqs.append(cq)
        return cq

    def create_qp(self, cq: CompletionQueue) -> QueuePair:
        if not isinstance(cq, SoftCompletionQueue):
            raise InvalidArgument(f"a {self.name} queue pair needs a {self.name} completion queue")
        with self._lock:
            self._check_open()
            qp = self._new_qp(self._qp_tag | next(self._qp_numbers) & QP_MASK, cq)
            self._qps[qp.qp_num] = qp
        return qp

    def _new_qp(self, qp_num: int, cq: SoftCompletionQueue) -> Q:
        """A new queue pair numbered ``qp_num`` on ``cq`` (under the backend's lock)."""
        raise NotImplementedError

    def _pairs(self) -> list[Q]:
        with self._lock:
            return list(self._qps.values())

    def _limits(self) -> tuple[int, int]:
        """The send-queue depth and SGEs a pair takes, for ``describe``."""
        return max(1, min(self.options.sq_depth, MAX_SEND_WR)), max(1, min(self.options.max_sge, MAX_SGE))

    def close(self) -> None:
        """Close every pair (flushing what is outstanding, joining its threads), then ``_stop`` what
        serves peers, close the completion queues and ``_forget_memory``. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            qps = list(self._qps.values())
            cqs = list(self._cqs)
        self._close_pairs(qps)
        self._stop()
        for cq in cqs:
            cq.close()
        self._forget_memory()

    def _close_pairs(self, qps: list[Q]) -> None:
        for qp in qps:
            qp.close()

    def _stop(self) -> None:
        """Stop serving peers (after the pairs closed)."""

    def _forget_memory(self) -> None:
        """Forget every region (last)."""

    def _forget(self, qp: SoftQueuePair) -> None:  # type: ignore[type-arg]
        with self._lock:
            self._qps.pop(qp.qp_num, None)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed(f"the {self.name} backend is closed")
