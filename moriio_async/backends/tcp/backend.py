"""TcpBackend: a software NIC over TCP.

Threads, per backend: the listener's accept thread and one thread per
accepted connection (``listener.py``, ``responder.py``); per active queue
pair: a sender and a receiver (``sender.py``, ``receiver.py``). None of them
touches asyncio, so a peer serves one-sided reads and writes of its memory
while its event loop is busy or blocked. The posting thread itself writes
READs and small WRITEs when the sender is idle (the doorbell); every copy of
payload bytes happens inside a socket call, with the GIL released.

Trust: a peer reaches only exported regions (``export_memory``; the rest are
unknown rkeys on the data plane), with a token derived from the control
link's session key when there is a shared secret (``qp.py``), within a total
deadline per message (``responder.py``); deregistration aborts a peer's
request in progress instead of waiting for it (``regions.py``). What peers
did wrong is counted in ``describe()["data_plane"]`` (``guard.py``).

Settings: ``TcpOptions`` (``IOEngineConfig(tcp=TcpOptions(...))``): the data port's hello bounds, and
``hooks`` (a ``Hooks``) or ``fault_plan`` (a ``FaultPlan``) for fault injection.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any, ClassVar

from ...errors import EngineClosed, InvalidArgument
from ...status import Access
from ..base import Backend, BackendOptions, CompletionQueue, MemoryRegion, QueuePair, specific_options
from ..options import TcpOptions
from ..softcq import SoftCompletionQueue
from .faults import hooks_from
from .guard import DataGuard
from .hooks import Hooks
from .listener import Listener
from .qp import MAX_SEND_WR, MAX_SGE, TcpQueuePair
from .regions import RegionTable
from .wire import VERSION

__all__ = ["TcpBackend"]


class TcpBackend(Backend):
    name: ClassVar[str] = "tcp"

    def __init__(self, options: BackendOptions) -> None:
        self.options = options
        self.own = specific_options(options, TcpOptions)
        self.hooks: Hooks | None = hooks_from(self.own)
        """Fault-injection hooks given to every queue pair created (see ``hooks.py``)."""
        self.regions = RegionTable()
        self.guard = DataGuard(max_failures=options.max_failures_per_source, lockout=options.failure_lockout)
        """What peers did wrong on this data plane (counters, rate-limited lines)."""
        self._lock = threading.Lock()
        self._closed = False
        self._qp_numbers = itertools.count(0x10)
        self._qps: dict[int, TcpQueuePair] = {}
        self._cqs: list[SoftCompletionQueue] = []
        self.listener = Listener(options, self.guard)

    @property
    def host(self) -> str:
        return self.listener.host

    @property
    def port(self) -> int:
        return self.listener.port

    # -- the contract -----------------------------------------------------------------

    def register_memory(self, buffer: memoryview, access: Access) -> MemoryRegion:
        self._check_open()
        return self.regions.register(buffer, access)

    def deregister_memory(self, region: MemoryRegion) -> None:
        """Invalidate the region. A peer's request moving its bytes right now is aborted (its
        socket shut down; it fails with REM_ACCESS_ERR), so the wait is as long as a woken
        system call takes to return, however slowly the peer sends."""
        self.regions.deregister(region)

    def export_memory(self, region: MemoryRegion) -> None:
        """From now on a peer's rkey finds ``region`` (before, it is an unknown rkey)."""
        self.regions.export(region)

    def watch_access_errors(self, listener: Callable[[int, str], None]) -> None:
        self.guard.listener = listener

    def create_cq(self, depth: int) -> CompletionQueue:
        self._check_open()
        cq = SoftCompletionQueue(depth)
        with self._lock:
            self._cqs.append(cq)
        return cq

    def create_qp(self, cq: CompletionQueue) -> QueuePair:
        if not isinstance(cq, SoftCompletionQueue):
            raise InvalidArgument("a tcp queue pair needs a tcp completion queue")
        with self._lock:
            self._check_open()
            qp_num = next(self._qp_numbers) & 0xFFFFFF
            qp = TcpQueuePair(qp_num, cq, self.regions, self.listener, self.options, self.hooks, self._forget)
            self._qps[qp.qp_num] = qp
        return qp

    def describe(self) -> dict[str, Any]:
        return {
            "backend": "tcp",
            "host": self.host,
            "data_port": self.port,
            "wire_version": VERSION,
            "sq_depth": max(1, min(self.options.sq_depth, MAX_SEND_WR)),
            "max_sge": max(1, min(self.options.max_sge, MAX_SGE)),
            "retry_timeout": self.options.retry_timeout,
            "threads": "accept 1; per active qp: send + recv; per accepted connection: 1",
            "data_plane": self.guard.snapshot(),
        }

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            qps = list(self._qps.values())
            cqs = list(self._cqs)
        for qp in qps:
            qp.close()  # flushes what is outstanding, joins its threads
        self.listener.close()
        for cq in cqs:
            cq.close()
        self.regions.clear()

    def _forget(self, qp: TcpQueuePair) -> None:
        with self._lock:
            self._qps.pop(qp.qp_num, None)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed("the tcp backend is closed")
