"""MockBackend: regions, completion queues and queue pairs of the in-process NIC."""

from __future__ import annotations

from typing import ClassVar

from ...errors import EngineClosed, InvalidArgument
from ...status import Access
from ..base import Backend, BackendOptions, CompletionQueue, MemoryRegion, QueuePair, specific_options
from ..described import MockFacts
from ..options import MockOptions
from ..soft.cq import SoftCompletionQueue
from .fabric import MockFabric
from .memory import MemoryTable
from .qp import MockQueuePair

__all__ = ["MockBackend"]


class MockBackend(Backend):
    name: ClassVar[str] = "mock"

    def __init__(self, options: BackendOptions) -> None:
        self.options = options
        self.own = specific_options(options, MockOptions)
        fabric = self.own.fabric
        if fabric is not None and not isinstance(fabric, MockFabric):
            raise InvalidArgument(f"MockOptions.fabric must be a MockFabric, not {type(fabric).__name__}")
        self.fabric = fabric if fabric is not None else MockFabric.default()
        self.memory = MemoryTable()
        self._qps: dict[int, MockQueuePair] = {}
        self._cqs: list[SoftCompletionQueue] = []
        self._closed = False

    def register_memory(self, buffer: memoryview, access: Access) -> MemoryRegion:
        self._check_open()
        return self.memory.register(buffer, access)

    def deregister_memory(self, region: MemoryRegion) -> None:
        self.memory.deregister(region)

    def create_cq(self, depth: int) -> CompletionQueue:
        self._check_open()
        cq = SoftCompletionQueue(depth, notify=not self.own.silent_cq)
        self._cqs.append(cq)
        return cq

    def create_qp(self, cq: CompletionQueue) -> QueuePair:
        self._check_open()
        if not isinstance(cq, SoftCompletionQueue):
            raise InvalidArgument("a mock queue pair needs a mock completion queue")
        qp = MockQueuePair(self.memory, cq, self.fabric, self.options, self._forget)
        self._qps[qp.qp_num] = qp
        return qp

    def describe(self) -> MockFacts:
        return MockFacts(
            backend="mock",
            hold=self.own.hold,
            silent_cq=self.own.silent_cq,
            sq_depth=max(1, self.options.sq_depth),
            max_sge=max(1, self.options.max_sge),
        )

    def close(self) -> None:
        """Flush and close every queue pair (a peer then sees a dead one), close every completion
        channel, forget every region. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for qp in list(self._qps.values()):
            qp.close()
        for cq in self._cqs:
            cq.close()
        self._cqs.clear()
        self.memory.clear()

    def _forget(self, qp: MockQueuePair) -> None:
        self._qps.pop(qp.qp_num, None)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed("the mock backend is closed")
