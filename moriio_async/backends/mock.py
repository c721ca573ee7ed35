"""An in-process backend that keeps the whole contract, for tests of the layers above.

Two engines in one process connect through it as through a NIC; a request
executes as a copy between their buffers, on the posting thread. It is public so users can test their own code against
moriio_async without sockets or RDMA. It is not evidence that a real backend
works: the TCP and verbs backends run the conformance suite for that.

Requests execute at once unless the backend was opened with
``extra={"hold": True}``: then each queue pair keeps its posted requests
until the test calls ``MockQueuePair.step(n)``, which makes completion timing
a plain function of the test's own calls (no sleeps, no threads). Faults:
``fail_next(status)`` ends the next executed request with that status, and
``vanish()`` behaves like a dead peer (RETRY_EXC_ERR, then flushes).
``extra={"silent_cq": True}`` makes completion queues raise no channel
events, as a NIC that lost a wakeup would: only an explicit drain sees them.
"""

from __future__ import annotations

import ctypes
import itertools
import secrets
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any, ClassVar

from ..errors import InvalidArgument
from ..status import Access, Opcode, WcStatus
from ..work import WorkBatch, WorkCompletion, WorkRequest
from .base import Backend, BackendOptions, CompletionQueue, Endpoint, MemoryRegion, QpState, QueuePair, SendQueueFull
from .tcp.cq import TcpCompletionQueue

__all__ = ["MockBackend", "MockQueuePair", "open_backend"]

_passive: dict[str, MockQueuePair] = {}
_registry_lock = threading.Lock()
_qp_numbers = itertools.count(0x100)


def _address_of(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class MockQueuePair(QueuePair):
    def __init__(self, backend: MockBackend, cq: TcpCompletionQueue) -> None:
        self.qp_num = next(_qp_numbers)
        self.max_send_wr = backend.options.sq_depth
        self.max_sge = backend.options.max_sge
        self._backend = backend
        self._cq = cq
        self._state = QpState.INIT
        self._token = secrets.token_hex(8)
        self._peer: MockQueuePair | None = None
        self._held: deque[WorkRequest] = deque()
        self._in_use = 0  # send-queue slots held until the covering completion is polled
        self._uncovered: deque[int] = deque()  # wr_ids no completion has covered yet, in order
        self._fail_next: WcStatus | None = None
        self.hold = bool(backend.options.extra.get("hold", False))

    @property
    def state(self) -> str:
        return self._state

    def endpoint(self) -> Endpoint:
        return {"token": self._token}

    def connect(self, remote: Endpoint) -> None:
        token = str(remote.get("token", ""))
        with _registry_lock:
            if self._peer is None and token not in _passive:
                _passive[self._token] = self  # passive side: wait for the active one
                self._state = QpState.RTS
                return
            peer = _passive.get(token)
        if peer is None:
            raise InvalidArgument(f"no mock queue pair with token {token!r}")
        self._peer = peer
        self._state = QpState.RTS

    def post(self, batch: WorkBatch) -> None:
        # Transitional: the per-request path below, until this backend posts batches natively.
        self.post_send(batch.requests())

    def post_send(self, wrs: Sequence[WorkRequest]) -> None:
        if self._in_use + len(wrs) > self.max_send_wr:
            raise SendQueueFull(f"{len(wrs)} requests, {self.max_send_wr - self._in_use} free slots")
        self._in_use += len(wrs)
        for wr in wrs:
            self._uncovered.append(wr.wr_id)
            self._held.append(wr)
        if not self.hold or self._state == QpState.ERR:
            self.step(len(self._held))

    def step(self, n: int = 1) -> int:
        """Execute up to ``n`` held requests, oldest first; return how many ran."""
        ran = 0
        while self._held and ran < n:
            wr = self._held.popleft()
            ran += 1
            status = self._execute(wr)
            if status is not WcStatus.SUCCESS or wr.signaled:
                self._complete(wr, status)
        return ran

    @property
    def held(self) -> int:
        return len(self._held)

    def fail_next(self, status: WcStatus) -> None:
        self._fail_next = status

    def vanish(self) -> None:
        """The peer died: the oldest held request fails RETRY_EXC_ERR, the rest flush."""
        if self._held and self._state != QpState.ERR:
            self._fail_next = WcStatus.RETRY_EXC_ERR
            self.step(len(self._held))
        self._state = QpState.ERR

    def _execute(self, wr: WorkRequest) -> WcStatus:
        if self._state == QpState.ERR or self._peer is None:
            return WcStatus.WR_FLUSH_ERR
        if self._fail_next is not None:
            status, self._fail_next = self._fail_next, None
            self._state = QpState.ERR
            return status
        local = [self._backend._local_slice(s.addr, s.length, s.lkey, wr.opcode) for s in wr.sges]
        if any(v is None for v in local):
            self._state = QpState.ERR
            return WcStatus.LOC_PROT_ERR
        remote = self._peer._backend._remote_slice(wr.remote_addr, wr.length, wr.rkey, wr.opcode)
        if remote is None:
            self._state = QpState.ERR
            return WcStatus.REM_ACCESS_ERR
        pos = 0
        for view in local:
            assert view is not None
            n = len(view)
            if wr.opcode is Opcode.RDMA_WRITE:
                remote[pos : pos + n] = view
            else:
                view[:] = remote[pos : pos + n]
            pos += n
        return WcStatus.SUCCESS

    def _complete(self, wr: WorkRequest, status: WcStatus) -> None:
        byte_len = wr.length if status is WcStatus.SUCCESS else 0
        covered = 0  # this completion covers every earlier request without one of its own
        while self._uncovered:
            covered += 1
            if self._uncovered.popleft() == wr.wr_id:
                break
        self._cq.push(WorkCompletion(wr.wr_id, status, wr.opcode, byte_len, self.qp_num), self, covered)

    def release_slots(self, n: int) -> None:
        self._in_use -= n

    def to_error(self) -> None:
        self._state = QpState.ERR
        self.step(len(self._held))

    def close(self) -> None:
        self.to_error()
        with _registry_lock:
            _passive.pop(self._token, None)


class MockBackend(Backend):
    name: ClassVar[str] = "mock"

    def __init__(self, options: BackendOptions) -> None:
        self.options = options
        self._regions: dict[int, MemoryRegion] = {}
        self._by_lkey: dict[int, MemoryRegion] = {}

    def register_memory(self, buffer: memoryview, access: Access) -> MemoryRegion:
        key = secrets.randbits(31) | 1
        while key in self._regions:
            key = secrets.randbits(31) | 1
        region = MemoryRegion(_address_of(buffer), buffer.nbytes, key, key, access, buffer)
        self._regions[key] = self._by_lkey[key] = region
        return region

    def deregister_memory(self, region: MemoryRegion) -> None:
        self._regions.pop(region.rkey, None)
        self._by_lkey.pop(region.lkey, None)

    def _local_slice(self, addr: int, length: int, lkey: int, opcode: Opcode) -> memoryview | None:
        region = self._by_lkey.get(lkey)
        if region is None or not region.addr <= addr <= addr + length <= region.addr + region.length:
            return None
        if opcode is Opcode.RDMA_READ and not region.access & Access.LOCAL_WRITE:
            return None
        return region.view[addr - region.addr : addr - region.addr + length]

    def _remote_slice(self, addr: int, length: int, rkey: int, opcode: Opcode) -> memoryview | None:
        region = self._regions.get(rkey)
        need = Access.REMOTE_WRITE if opcode is Opcode.RDMA_WRITE else Access.REMOTE_READ
        if region is None or not region.access & need:
            return None
        if not region.addr <= addr <= addr + length <= region.addr + region.length:
            return None
        return region.view[addr - region.addr : addr - region.addr + length]

    def create_cq(self, depth: int) -> CompletionQueue:
        return TcpCompletionQueue(depth, notify=not self.options.extra.get("silent_cq", False))

    def create_qp(self, cq: CompletionQueue) -> QueuePair:
        if not isinstance(cq, TcpCompletionQueue):
            raise InvalidArgument("a mock queue pair needs a mock completion queue")
        return MockQueuePair(self, cq)

    def describe(self) -> dict[str, Any]:
        return {"backend": "mock", "hold": bool(self.options.extra.get("hold", False))}

    def close(self) -> None:
        self._regions.clear()
        self._by_lkey.clear()


def open_backend(options: BackendOptions) -> Backend:
    return MockBackend(options)
