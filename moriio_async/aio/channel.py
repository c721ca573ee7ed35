"""A queue pair seen from the event loop: posting with backpressure, completions to transfers.

All of it runs on the loop thread: ``submit`` and ``on_completion`` are plain
calls (no task, no lock). The queue pair itself may be replaced after it
failed; the channel and the transfers waiting in it stay.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from ..backends.base import QueuePair
from ..core.plan import Plan
from ..core.sendq import LAST_ONLY, SendQueue
from ..status import Opcode, StatusCode, WcStatus
from ..work import WorkBatch, WorkCompletion
from .transfer import Transfer

__all__ = ["ChannelState", "Job", "QpChannel", "cached_key_pairs"]


def _frozen(a: npt.NDArray[Any]) -> npt.NDArray[Any]:
    a.flags.writeable = False
    return a


# Shared by every single-request job: WorkBatch arrays are never written.
_READ = Opcode.RDMA_READ
_READ_ONE = _frozen(np.array((int(Opcode.RDMA_READ),), dtype=np.uint8))
_WRITE_ONE = _frozen(np.array((int(Opcode.RDMA_WRITE),), dtype=np.uint8))
_NOT_SIGNALED_ONE = _frozen(np.zeros(1, dtype=np.bool_))
_SGE_START_ONE = _frozen(np.array((0, 1), dtype=np.int64))


_KEYS: dict[tuple[int, int], tuple[npt.NDArray[np.uint32], npt.NDArray[np.uint32]]] = {}


def _keys(rkey: int, lkey: int) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.uint32]]:
    """A session's two keys as one-element arrays, made once (a session posts under the same pair)."""
    if len(_KEYS) >= 1024:
        _KEYS.clear()
    both = _frozen(np.array((rkey, lkey), dtype=np.uint32))
    keys = _KEYS[rkey, lkey] = (both[0:1], both[1:2])
    return keys


def cached_key_pairs() -> int:
    """How many (rkey, lkey) pairs single-request jobs hold as arrays now (at most 1024; inspection)."""
    return len(_KEYS)


class Job:
    """One transfer's work requests, ready to post: the plan with absolute addresses and keys, as arrays."""

    __slots__ = ("_batch", "transfer")

    def __init__(
        self,
        transfer: Transfer,
        plan: Plan,
        opcode: Opcode,
        *,
        local_addr: int,
        lkey: int,
        remote_addr: int,
        rkey: int,
    ) -> None:
        self.transfer = transfer
        n, m = len(plan), len(plan.sge_offset)
        # wr_id and the signal flags are decided per chunk at posting time; this is the template.
        self._batch = WorkBatch(
            0,
            np.full(n, int(opcode), dtype=np.uint8),
            plan.remote_offset.astype(np.uint64) + np.uint64(remote_addr),
            np.full(n, rkey, dtype=np.uint32),
            plan.length.astype(np.uint64),
            np.zeros(n, dtype=np.bool_),
            plan.sge_start,
            plan.sge_offset.astype(np.uint64) + np.uint64(local_addr),
            plan.sge_length.astype(np.uint64),
            np.full(m, lkey, dtype=np.uint32),
        )

    @classmethod
    def single(
        cls, transfer: Transfer, opcode: Opcode, *, local_addr: int, lkey: int, remote_addr: int, rkey: int, size: int
    ) -> Job:
        """One request with one scatter entry: a handful of tiny arrays, no planning."""
        job = cls.__new__(cls)
        job.transfer = transfer
        v = np.empty(3, dtype=np.uint64)  # filled item by item: faster than converting a tuple
        v[0] = remote_addr
        v[1] = size
        v[2] = local_addr
        keys = _KEYS.get((rkey, lkey))
        if keys is None:
            keys = _keys(rkey, lkey)
        job._batch = WorkBatch(
            0,
            _READ_ONE if opcode is _READ else _WRITE_ONE,
            v[0:1],
            keys[0],
            v[1:2],
            _NOT_SIGNALED_ONE,
            _SGE_START_ONE,
            v[2:3],
            v[1:2],
            keys[1],
        )
        return job

    def __len__(self) -> int:
        return len(self._batch)

    def chunk(self, start: int, stop: int, wr_id: int, signaled: npt.NDArray[np.bool_]) -> WorkBatch:
        """Requests ``start:stop`` as a batch numbered from ``wr_id``."""
        b = self._batch
        if start == 0 and stop == len(b):
            # The whole job goes out in one post, which happens once: number the template itself.
            b.wr_id = wr_id
            b.signaled = signaled
            return b
        b = b.slice(start, stop)
        b.wr_id = wr_id
        b.signaled = signaled
        return b


class ChannelState(enum.StrEnum):
    """A channel's state (a ``str``: ``Session.statistics().state`` shows it as before)."""

    READY = "ready"
    FAILED = "failed"
    """The pair failed; waiting requests are kept until a new pair replaces it."""
    CLOSED = "closed"


class QpChannel:
    """Send-queue accounting around one (replaceable) queue pair."""

    def __init__(
        self,
        qp: QueuePair,
        *,
        on_failed_idle: Callable[[QpChannel], None] = lambda ch: None,
        on_post: Callable[[], None] = lambda: None,
    ) -> None:
        self.qp = qp
        self.sendq: SendQueue[Job] = SendQueue(qp.max_send_wr)
        self.state = ChannelState.READY
        self.posted = 0
        self.max_in_flight = 0
        self._on_failed_idle = on_failed_idle
        self._on_post = on_post
        self._idle_waiters: list[asyncio.Future[None]] = []

    @property
    def qp_num(self) -> int:
        return self.qp.qp_num

    @property
    def in_flight(self) -> int:
        return self.sendq.in_flight

    @property
    def waiting(self) -> int:
        return self.sendq.waiting

    def submit(self, job: Job) -> None:
        """Queue a transfer's requests and post what fits. Never blocks, never fails for lack of room."""
        n = len(job)
        job.transfer.start(n)
        if n == 1:
            # The single read/write on a pair with room and nothing queued: straight to the NIC.
            wr_id = self.sendq.post_one(job)
            if wr_id is not None:
                self.qp.post(job.chunk(0, 1, wr_id, LAST_ONLY))
                self.posted += 1
                if self.sendq.in_flight > self.max_in_flight:
                    self.max_in_flight = self.sendq.in_flight
                self._on_post()
                return
        self.sendq.enqueue(job, n)
        if self.state == ChannelState.FAILED and not self.sendq.in_flight:
            self._on_failed_idle(self)
        else:
            self._pump()

    def _pump(self) -> None:
        chunks = self.sendq.take_postable()
        if not chunks:
            return
        post = self.qp.post
        for c in chunks:
            post(c.owner.chunk(c.start, c.stop, c.wr_id, c.signaled))
            self.posted += c.stop - c.start
        self.max_in_flight = max(self.max_in_flight, self.sendq.in_flight)
        self._on_post()

    def on_completion(self, wc: WorkCompletion) -> None:
        """Account one completion and post what the freed slots allow."""
        self.account(wc)
        self.resume()

    def account(self, wc: WorkCompletion) -> None:
        """Settle what ``wc`` covers, without posting: a caller holding several completions accounts
        them all, then calls ``resume`` once, so the freed slots go out as one chunk, not one per
        completion (on a deep queue, each signaled completion frees ``depth // 4`` slots)."""
        settled = self.sendq.complete(wc.wr_id, wc.status)
        if len(settled) == 1:
            job, count, status = settled[0]
            job.transfer.settle(count, status, wc.vendor_err, self.qp.qp_num)
        else:
            qp_num = self.qp.qp_num
            last = len(settled) - 1
            for i, (job, count, status) in enumerate(settled):
                # Only the named request carries the completion's vendor error.
                job.transfer.settle(count, status, wc.vendor_err if i == last else 0, qp_num)
        if self.sendq.failed:
            self.state = ChannelState.FAILED if self.state != ChannelState.CLOSED else self.state
            if not self.sendq.in_flight:
                self._settle_failed()
        self._wake_idle()

    def resume(self) -> None:
        """Post what fits now (nothing once the pair failed)."""
        if not self.sendq.failed and self.sendq.waiting:
            self._pump()

    def _settle_failed(self) -> None:
        """The failed pair has drained: requests queued before the failure flush, in order."""
        for job, count, status in self.sendq.flush_waiting():
            job.transfer.settle(count, status, 0, self.qp.qp_num)

    def replace_qp(self, qp: QueuePair) -> None:
        """A reconnected pair takes over; waiting requests post on it."""
        self.qp = qp
        self.sendq.reset()
        self.state = ChannelState.READY
        self._pump()

    def fail_waiting(self, status: WcStatus = WcStatus.WR_FLUSH_ERR) -> list[Transfer]:
        """End every waiting (unposted) request; return the transfers touched."""
        touched = []
        for job, count in self.sendq.drop_waiting():
            job.transfer.settle(count, status, 0, self.qp.qp_num)
            touched.append(job.transfer)
        self._wake_idle()
        return touched

    def abandon_waiting(self, code: StatusCode, message: str, hint: str) -> None:
        """End every waiting transfer without posting it (e.g. its peer restarted meanwhile)."""
        for job, _ in self.sendq.drop_waiting():
            job.transfer.fail(code, message, hint)
        self._wake_idle()

    def force_fail_in_flight(self) -> None:
        """The backend will never report these (device gone): end them as flushed."""
        for job, count, status in self.sendq.fail_all_in_flight():
            job.transfer.settle(count, status, 0, self.qp.qp_num)
        self.state = ChannelState.FAILED
        self._wake_idle()

    def begin_abort(self) -> None:
        """Move the pair to the error state; its flush completions arrive through the CQ."""
        self.sendq.failed = True
        self.state = ChannelState.FAILED
        self.qp.to_error()
        if not self.sendq.in_flight:
            self.fail_waiting()

    @property
    def idle(self) -> bool:
        return self.sendq.idle

    async def wait_idle(self) -> None:
        while not self.sendq.idle:
            fut = asyncio.get_running_loop().create_future()
            self._idle_waiters.append(fut)
            await fut

    def _wake_idle(self) -> None:
        if self.sendq.idle and self._idle_waiters:
            waiters, self._idle_waiters = self._idle_waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)
