"""TcpBackend: a software NIC over TCP.

Threads, per backend: ``TcpOptions.reactor_threads`` reactor threads that
accept and serve every accepted connection, readiness-driven on non-blocking
sockets, so a target's threads do not grow with its peers (``reactor.py``,
``listener.py``, ``responder.py``); per active queue pair: a sender and a receiver
(``sender.py``, ``receiver.py``); per answering pair with fault hooks, a
thread for its hooks (which may block). None of them
touches asyncio, so a peer serves one-sided reads and writes of its memory
while its event loop is busy or blocked. The posting thread itself writes
READs and small WRITEs when the sender is idle (the doorbell); every copy of
payload bytes happens inside a socket call, with the GIL released.

Trust: a peer reaches only exported regions (``export_memory``; the rest are
unknown rkeys on the data plane), with a token derived from the control
link's session key when there is a shared secret (``qp.py``), within a total
deadline per message (``responder.py``); deregistration aborts a peer's
request in progress instead of waiting for it (``regions.py``). What peers
did wrong is counted in ``describe().data_plane`` (``guard.py``).

Settings: ``TcpOptions`` (``IOEngineConfig(tcp=TcpOptions(...))``): the data port's hello bounds, and
``hooks`` (a ``Hooks``) or ``fault_plan`` (a ``FaultPlan``) for fault injection.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from ...status import Access
from ..base import BackendOptions, MemoryRegion, specific_options
from ..described import TcpFacts
from ..options import TcpOptions
from ..soft.backend import SoftBackend
from ..soft.cq import SoftCompletionQueue
from .faults import hooks_from
from .guard import DataGuard
from .hooks import Hooks
from .listener import Listener
from .pairstate import PairState
from .qp import TcpQueuePair
from .regions import RegionTable
from .wire import VERSION

__all__ = ["TcpBackend"]


class TcpBackend(SoftBackend[TcpQueuePair]):
    name: ClassVar[str] = "tcp"

    def __init__(self, options: BackendOptions) -> None:
        super().__init__(options)
        self.own = specific_options(options, TcpOptions)
        self.hooks: Hooks | None = hooks_from(self.own)
        """Fault-injection hooks given to every queue pair created (see ``hooks.py``)."""
        self.regions = RegionTable()
        self.guard = DataGuard(max_failures=options.max_failures_per_source, lockout=options.failure_lockout)
        """What peers did wrong on this data plane (counters, rate-limited lines)."""
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

    def _new_qp(self, qp_num: int, cq: SoftCompletionQueue) -> TcpQueuePair:
        st = PairState(qp_num, cq, self.regions, self.hooks, self.options.retry_timeout)
        return TcpQueuePair(st, self.listener, self.options, self._forget)

    def describe(self) -> TcpFacts:
        sq_depth, max_sge = self._limits()
        return TcpFacts(
            backend="tcp",
            host=self.host,
            data_port=self.port,
            wire_version=VERSION,
            sq_depth=sq_depth,
            max_sge=max_sge,
            retry_timeout=self.options.retry_timeout,
            threads=f"reactors {len(self.listener.reactors)} (serving every accepted connection; the first accepts); "
            "per active qp: send + recv",
            data_plane=self.guard.snapshot(),
        )

    def _stop(self) -> None:
        self.listener.close()

    def _forget_memory(self) -> None:
        self.regions.clear()
