"""A queue pair seen from the event loop: posting with backpressure, completions to transfers.

All of it runs on the loop thread: ``submit`` and ``on_completion`` are plain
calls (no task, no lock). The queue pair itself may be replaced after it
failed; the channel and the transfers waiting in it stay.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from ..backends.base import QueuePair
from ..core.plan import FewPlan, Plan
from ..core.sendq import SendQueue
from ..status import Opcode, StatusCode, WcStatus
from ..work import WorkBatch, WorkCompletion, cached_key_pairs
from .transfer import Transfer

__all__ = ["ChannelState", "Job", "QpChannel", "cached_key_pairs"]


class Job:
    """One transfer's work requests, ready to post: the plan with absolute addresses and keys, as arrays.

    A single read or write keeps its one request as plain integers (``one``) and posts them with
    ``QueuePair.post_one``; it becomes a batch only if it has to wait for room (``chunk``).
    """

    __slots__ = ("_batch", "one", "transfer")

    def __init__(
        self,
        transfer: Transfer,
        plan: Plan | None,
        opcode: Opcode,
        local_addr: int,
        lkey: int,
        remote_addr: int,
        rkey: int,
        size: int = 0,
    ) -> None:
        """The job of ``plan``; with no plan, the single request of ``size`` bytes (``single``)."""
        self.transfer = transfer
        if plan is None:
            self._batch: WorkBatch | None = None
            self.one: tuple[Opcode, int, int, int, int, int] | None = (
                opcode, local_addr, lkey, remote_addr, rkey, size
            )  # fmt: skip
            return
        self.one = None
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
        """One request with one scatter entry: six integers, no planning, no arrays."""
        return cls(transfer, None, opcode, local_addr=local_addr, lkey=lkey, remote_addr=remote_addr, rkey=rkey,
                   size=size)  # fmt: skip

    @classmethod
    def few(
        cls, transfer: Transfer, plan: FewPlan, opcode: Opcode, *, local_addr: int, lkey: int, remote_addr: int,
        rkey: int,
    ) -> Job:  # fmt: skip
        """The job of a few blocks planned on ints (``plan_few``): ``single`` if they make one request of
        one entry, else the batch built from the ints (three small arrays and shared constants)."""
        w_remote, w_len, w_start, s_off, s_len = plan
        n, m = len(w_remote), len(s_off)
        if m == 1:
            return cls.single(transfer, opcode, local_addr=local_addr + s_off[0], lkey=lkey,
                              remote_addr=remote_addr + w_remote[0], rkey=rkey, size=w_len[0])  # fmt: skip
        job = cls.__new__(cls)
        job.transfer = transfer
        job.one = None
        u64 = np.array([remote_addr + r for r in w_remote] + w_len + [local_addr + o for o in s_off] + s_len, np.uint64)
        keys = np.array([rkey] * n + [lkey] * m, dtype=np.uint32)
        e = 2 * n + m
        job._batch = WorkBatch(
            0, _opcodes(opcode, n), u64[:n], keys[:n], u64[n : 2 * n], _unsignaled(n), np.array(w_start, np.int64),
            u64[2 * n : e], u64[e:], keys[n:],
        )  # fmt: skip
        return job

    def __len__(self) -> int:
        return 1 if self._batch is None else len(self._batch)

    def chunk(self, start: int, stop: int, wr_id: int, signaled: npt.NDArray[np.bool_]) -> WorkBatch:
        """Requests ``start:stop`` as a batch numbered from ``wr_id``."""
        b = self._batch
        if b is None:
            assert self.one is not None
            b = WorkBatch.one(wr_id, *self.one)
        elif start == 0 and stop == len(b):
            # The whole job goes out in one post, which happens once: number the template itself.
            b.wr_id = wr_id
        else:
            b = b.slice(start, stop)
            b.wr_id = wr_id
        b.signaled = signaled
        return b


_CONSTANT: dict[tuple[int, int], npt.NDArray[np.generic]] = {}


def _opcodes(opcode: Opcode, n: int) -> npt.NDArray[np.uint8]:
    """``n`` copies of ``opcode``, one read-only array per (opcode, n) (batches never write theirs)."""
    got = _CONSTANT.get((int(opcode), n))
    if got is None:
        got = _CONSTANT[int(opcode), n] = np.full(n, int(opcode), dtype=np.uint8)
        got.flags.writeable = False
    return got  # type: ignore[return-value]


def _unsignaled(n: int) -> npt.NDArray[np.bool_]:
    """A template's signal flags (``chunk`` replaces them when it posts), shared and read-only."""
    got = _CONSTANT.get((-1, n))
    if got is None:
        got = _CONSTANT[-1, n] = np.zeros(n, dtype=np.bool_)
        got.flags.writeable = False
    return got  # type: ignore[return-value]


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
        on_post: Callable[[], None] | None = None,
    ) -> None:
        self.qp = qp
        self.sendq: SendQueue[Job] = SendQueue(qp.max_send_wr)
        self.state = ChannelState.READY
        self.posted = 0
        self.max_in_flight = 0
        self._on_failed_idle = on_failed_idle
        self._on_post = on_post
        self._idle_waiters: list[asyncio.Future[None]] = []
        self._post_due = False

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
        """Queue a transfer's requests and post what fits. Never blocks, never fails for lack of room.

        A single read or write goes to the NIC at once when nothing is in flight on the pair. On a pair
        that ``gathers_singles`` (tcp) with requests in flight it waits for the end of this pass of the
        event loop (Nagle's rule for posts: the pair is busy anyway), so the singles that tasks woken
        together post go out as one batch: one post, one system call and one wire chunk instead of one
        of each per request.
        """
        one = job.one
        sendq = self.sendq
        gather = one is not None and sendq.in_flight > 0 and self.qp.gathers_singles
        if one is not None:
            job.transfer.start(1)
            wr_id = None if gather else sendq.post_one(job)
            if wr_id is not None:
                self.qp.post_one(wr_id, *one)
                self.posted += 1
                if sendq.in_flight > self.max_in_flight:
                    self.max_in_flight = sendq.in_flight
                if self._on_post is not None:
                    self._on_post()
                return
            n = 1
        else:
            n = len(job)
            job.transfer.start(n)
        sendq.enqueue(job, n)
        if self.state == ChannelState.FAILED and not sendq.in_flight:
            self._on_failed_idle(self)
        elif gather:
            self._post_soon()
        else:
            self._pump()

    def _post_soon(self) -> None:
        """Post what waits at the end of this loop pass (once, however many singles queue meanwhile)."""
        if self._post_due:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # driven by hand, with no loop running: post now
            self._pump()
            return
        self._post_due = True
        loop.call_soon(self._posted_soon)

    def _posted_soon(self) -> None:
        self._post_due = False
        self.resume()  # nothing if a completion's resume or a batch's submit posted them meanwhile

    def _pump(self) -> None:
        chunks = self.sendq.take_postable()
        if not chunks:
            return
        post = self.qp.post
        i, n = 0, len(chunks)
        while i < n:
            c = chunks[i]
            j = i + 1
            if c.owner.one is not None:
                while j < n and chunks[j].owner.one is not None:
                    j += 1
            if j > i + 1:  # singles queued together (one request each, signaled, consecutive wr_ids)
                post(WorkBatch.singles(c.wr_id, [one for d in chunks[i:j] if (one := d.owner.one) is not None]))
                self.posted += j - i
            elif (one := c.owner.one) is not None:  # a single alone: its own fast path, no batch to build
                self.qp.post_one(c.wr_id, *one)
                self.posted += 1
            else:
                post(c.owner.chunk(c.start, c.stop, c.wr_id, c.signaled))
                self.posted += c.stop - c.start
            i = j
        self.max_in_flight = max(self.max_in_flight, self.sendq.in_flight)
        if self._on_post is not None:
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
        if self._idle_waiters and self.sendq.idle:
            waiters, self._idle_waiters = self._idle_waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)
