"""The mock queue pair: a posted batch runs as array checks and array copies, in posting order.

Everything happens on the thread that posts (and, in ``hold`` mode, on the
thread that calls ``step``); the completion queue is the only thing shared
with the poller. A batch is cut into runs of one opcode; each run is checked
and copied by ``execute.py`` (the requests before the first failing one
run), and the pair turns the outcome into completions: only signaled
successes, the failure and the flushes after it make one.
"""

from __future__ import annotations

import itertools
import secrets
from collections import deque
from collections.abc import Callable

import numpy as np

from ...errors import InvalidArgument, PeerError
from ...status import Access, Opcode, WcStatus
from ...work import WorkBatch, WorkCompletion
from ..base import TAG_SHIFT, BackendOptions, Endpoint, QpState, QueuePair, SendQueueFull, specific_options
from ..options import MockOptions
from ..soft.cq import SoftCompletionQueue
from .execute import FEW, execute, execute_few
from .fabric import MockFabric
from .memory import MemoryTable

__all__ = ["MockQueuePair"]

_OPCODES = {int(o): o for o in Opcode}
_WRITE = int(Opcode.RDMA_WRITE)
_READ = int(Opcode.RDMA_READ)
_SUCCESS = WcStatus.SUCCESS
# ufunc reductions called directly: ndarray.all()/max()/min() and np.diff go through Python wrappers that
# cost more than the work on a chunk's few hundred entries.
_ALL, _MAX, _MIN, _SUB = np.logical_and.reduce, np.maximum.reduce, np.minimum.reduce, np.subtract
_NEED_READ_LOCAL, _NEED_WRITE_LOCAL = int(Access.LOCAL_WRITE), 0
_NEED_READ_REMOTE, _NEED_WRITE_REMOTE = int(Access.REMOTE_READ), int(Access.REMOTE_WRITE)
_FLUSH = WcStatus.WR_FLUSH_ERR
_OP_READ, _OP_WRITE = Opcode.RDMA_READ, Opcode.RDMA_WRITE
_RTS = QpState.RTS

Completions = list[tuple[WorkCompletion, int]]


class MockQueuePair(QueuePair):
    """A queue pair of the mock NIC. Test seams: ``hold``/``step``, ``fail_next``, ``vanish``.

    Not thread-safe beyond the contract's use: one thread posts (and steps),
    any thread polls the completion queue.
    """

    def __init__(
        self,
        memory: MemoryTable,
        cq: SoftCompletionQueue,
        fabric: MockFabric,
        options: BackendOptions,
        on_close: Callable[[MockQueuePair], None],
    ) -> None:
        self.qp_num = options.qp_tag << TAG_SHIFT | fabric.next_qp_num()
        self.max_send_wr = max(1, options.sq_depth)
        self.max_sge = max(1, options.max_sge)
        self.hold = specific_options(options, MockOptions).hold
        """Keep posted requests until ``step``: completion timing becomes a function of the test's calls."""
        self.memory = memory
        self._cq = cq
        self._fabric = fabric
        self._on_close = on_close
        self._token = secrets.token_hex(8)
        self._state = QpState.INIT
        self._passive = False
        self._closed = False
        self._peer: MockQueuePair | None = None
        self._held: deque[WorkBatch] = deque()
        self._held_n = 0
        self._posted = 0
        self._released = 0  # written by the poller (release_slots)
        self._uncovered = 0  # successful unsignaled requests the next completion covers
        self._fail_next: WcStatus | None = None

    # -- the contract -----------------------------------------------------------------

    @property
    def state(self) -> QpState:
        return self._state

    @property
    def closed(self) -> bool:
        return self._closed

    def endpoint(self) -> Endpoint:
        return {"backend": "mock", "token": self._token, "qp_num": self.qp_num, "accepting": self._passive}

    def connect(self, remote: Endpoint) -> None:
        if remote.get("backend", "mock") != "mock":
            raise InvalidArgument(f"not a mock queue-pair endpoint: {dict(remote)!r}")
        if self._closed or self._state != QpState.INIT:
            raise InvalidArgument(f"connect needs a queue pair in INIT (qp {self.qp_num} is {self._state})")
        if not remote.get("accepting"):
            # Passive side: the active pair connects to us next, by our token.
            self._passive = True
            self._state = QpState.RTS
            self._fabric.listen(self._token, self)
            return
        token = str(remote.get("token", ""))
        peer = self._fabric.claim(token)
        if not isinstance(peer, MockQueuePair) or peer.closed:
            raise PeerError(
                f"qp {self.qp_num}: no mock queue pair with token {token!r} waits in this fabric",
                hint="the mock connects engines of one process (and one MockFabric); use tcp across processes",
            )
        self._peer = peer
        self._state = QpState.RTS

    def post(self, batch: WorkBatch) -> None:
        n = len(batch)
        if self._passive or self._closed or self._state not in (QpState.RTS, QpState.ERR):
            raise InvalidArgument(
                f"qp {self.qp_num} cannot post: "
                + ("the passive pair only answers" if self._passive else f"it is {self._state}")
                + (" and closed" if self._closed else "")
            )
        if not n:
            return
        ops = batch.opcode
        if n <= FEW:
            for op in ops.tolist():
                if op != _WRITE and op != _READ:
                    raise InvalidArgument(f"unsupported opcode {op}")
            starts = batch.sge_start.tolist()
            most = max(b - a for a, b in itertools.pairwise(starts))
        else:
            low, high = int(_MIN(ops)), int(_MAX(ops))
            if not (low == high and low in (_WRITE, _READ)) and not bool(_ALL((ops == _WRITE) | (ops == _READ))):
                bad = int(ops[(ops != _WRITE) & (ops != _READ)][0])
                raise InvalidArgument(f"unsupported opcode {bad}")
            starts = batch.sge_start
            most = int(_MAX(_SUB(starts[1:], starts[:-1])))
        if most > self.max_sge:
            raise InvalidArgument(f"{most} SGEs, qp {self.qp_num} takes at most {self.max_sge}")
        used = self._posted - self._released
        if used + n > self.max_send_wr:
            raise SendQueueFull(f"{n} requests, {self.max_send_wr - used} free slots of {self.max_send_wr}")
        self._posted += n
        self._held.append(batch)
        self._held_n += n
        if not self.hold or self._state == QpState.ERR:
            self.step(self._held_n)

    def post_one(
        self, wr_id: int, opcode: Opcode, local_addr: int, lkey: int, remote_addr: int, rkey: int, length: int
    ) -> None:
        """The single read/write that succeeds: checked, copied and completed on plain integers. Anything
        unusual (a state ``post`` refuses, held requests, a fault to inject, a failing check) goes to
        ``post`` of the same request as a batch, which refuses it or runs and reports it the long way."""
        peer = self._peer
        if (
            self._state is _RTS
            and not self.hold
            and not self._held
            and self._fail_next is None
            and peer is not None
            and not peer._closed
            and self._posted - self._released < self.max_send_wr
        ):
            if opcode is _OP_READ:
                mine = self.memory.lookup(lkey, local_addr, length, _NEED_READ_LOCAL)
                theirs = peer.memory.lookup(rkey, remote_addr, length, _NEED_READ_REMOTE)
            elif opcode is _OP_WRITE:
                mine = self.memory.lookup(lkey, local_addr, length, _NEED_WRITE_LOCAL)
                theirs = peer.memory.lookup(rkey, remote_addr, length, _NEED_WRITE_REMOTE)
            else:
                mine = theirs = None
            if mine is not None and theirs is not None:
                self._posted += 1
                here, there = local_addr - mine.addr, remote_addr - theirs.addr
                # memoryview slices: the same bytes as the regions' arrays, at a fraction of numpy's per-call cost.
                if opcode is _OP_READ:
                    mine.view[here : here + length] = theirs.view[there : there + length]
                else:
                    theirs.view[there : there + length] = mine.view[here : here + length]
                slots, self._uncovered = self._uncovered + 1, 0
                self._cq.push(WorkCompletion(wr_id, _SUCCESS, opcode, length, self.qp_num), self, slots)
                return
        self.post(WorkBatch.one(wr_id, opcode, local_addr, lkey, remote_addr, rkey, length))

    def to_error(self) -> None:
        self._state = QpState.ERR
        self.step(self._held_n)

    def close(self) -> None:
        if self._closed:
            return
        self.to_error()
        self._closed = True
        self._fabric.forget(self._token)
        self._on_close(self)

    def release_slots(self, n: int) -> None:
        self._released += n

    # -- test seams -------------------------------------------------------------------

    @property
    def held(self) -> int:
        """Requests posted and not executed yet (``hold`` mode)."""
        return self._held_n

    def step(self, n: int = 1) -> int:
        """Execute up to ``n`` held requests, oldest first; return how many ran."""
        ran = 0
        out: Completions = []
        while self._held and ran < n:
            batch = self._held[0]
            k = min(len(batch), n - ran)
            if k < len(batch):
                part = batch.slice(0, k)
                self._held[0] = batch.slice(k)
            else:
                part = self._held.popleft()
            self._held_n -= k
            ran += k
            self._run(part, out)
        if out:
            self._cq.push_many(out, self)
        return ran

    def fail_next(self, status: WcStatus) -> None:
        """The next executed request ends with ``status`` (the pair then enters ERR)."""
        self._fail_next = status

    def vanish(self) -> None:
        """The peer died: the oldest held request fails RETRY_EXC_ERR, the rest flush."""
        if self._held_n and self._state != QpState.ERR:
            self._fail_next = WcStatus.RETRY_EXC_ERR
            self.step(self._held_n)
        self._state = QpState.ERR

    # -- execution ----------------------------------------------------------------------

    def _run(self, batch: WorkBatch, out: Completions) -> None:
        if self._state == QpState.ERR:
            self._fail(batch, 0, _FLUSH, out)
            return
        peer = self._peer
        if peer is None or peer.closed:
            self._fail(batch, 0, WcStatus.RETRY_EXC_ERR, out)  # nothing answers: the retries run out
            return
        if self._fail_next is not None:
            chosen, self._fail_next = self._fail_next, None
            self._fail(batch, 0, chosen, out)
            return
        n = len(batch)
        if n <= FEW:  # a few requests: plain integers, no array work
            done, status = execute_few(self.memory, batch, peer.memory)
            self._complete_ok(batch, 0, done, out)
            if status is not None:
                self._fail(batch, done, status, out)
            return
        ops = batch.opcode
        if ops.item(0) == ops.item(n - 1) and int(_MIN(ops)) == int(_MAX(ops)):
            cuts = [0, n]
        else:
            cuts = [0, *(np.flatnonzero(np.diff(ops)) + 1).tolist(), n]
        for lo, hi in itertools.pairwise(cuts):
            done, status = execute(self.memory, batch, lo, hi, peer.memory)
            self._complete_ok(batch, lo, lo + done, out)
            if status is not None:
                self._fail(batch, lo + done, status, out)
                return

    def _complete_ok(self, batch: WorkBatch, lo: int, hi: int, out: Completions) -> None:
        """Requests ``lo:hi`` succeeded: a completion for each signaled one, covering those before it."""
        if hi <= lo:
            return
        if hi - lo <= FEW:
            signaled = [i for i, flag in enumerate(batch.signaled[lo:hi].tolist(), start=lo) if flag]
        else:
            signaled = (np.flatnonzero(batch.signaled[lo:hi]) + lo).tolist()
        if not signaled:
            self._uncovered += hi - lo
            return
        prev = lo - 1 - self._uncovered
        ops, lengths, first, qp_num = batch.opcode, batch.length, batch.wr_id, self.qp_num
        for i in signaled:
            wc = WorkCompletion(first + i, _SUCCESS, _OPCODES[ops.item(i)], lengths.item(i), qp_num)
            out.append((wc, i - prev))
            prev = i
        self._uncovered = hi - 1 - prev

    def _fail(self, batch: WorkBatch, i: int, status: WcStatus, out: Completions) -> None:
        """Request ``i`` fails with ``status``, every later one flushes; the pair is in ERR."""
        self._state = QpState.ERR
        slots = self._uncovered + 1
        self._uncovered = 0
        first, qp_num = batch.wr_id, self.qp_num
        for j, op in enumerate(batch.opcode[i:].tolist(), start=i):
            out.append((WorkCompletion(first + j, status, _OPCODES[op], 0, qp_num), slots))
            status, slots = _FLUSH, 1
