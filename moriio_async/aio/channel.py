"""A queue pair seen from the event loop: posting with backpressure, completions to transfers.

All of it runs on the loop thread: ``submit`` and ``on_completion`` are plain
calls (no task, no lock). The queue pair itself may be replaced after it
failed; the channel and the transfers waiting in it stay.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from ..backends.base import QueuePair
from ..core.sendq import Entry, SendQueue
from ..status import Opcode, WcStatus
from ..work import Sge, WorkCompletion, WorkRequest
from .transfer import Transfer

__all__ = ["ChannelState", "QpChannel", "RequestSpec"]


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """A work request before its wr_id and signaling are decided."""

    opcode: Opcode
    sges: tuple[Sge, ...]
    remote_addr: int
    rkey: int


class ChannelState:
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
        self.sendq: SendQueue[Transfer] = SendQueue(qp.max_send_wr)
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
        return len(self.sendq.in_flight)

    @property
    def waiting(self) -> int:
        return len(self.sendq.waiting)

    def submit(self, transfer: Transfer, specs: list[RequestSpec]) -> None:
        """Queue a transfer's requests and post what fits. Never blocks, never fails for lack of room."""
        transfer._start(len(specs))
        last = len(specs) - 1
        self.sendq.enqueue([Entry(transfer, spec, i == last) for i, spec in enumerate(specs)])
        if self.state == ChannelState.FAILED and not self.sendq.in_flight:
            self._on_failed_idle(self)
        else:
            self._pump()

    def _pump(self) -> None:
        entries = self.sendq.take_postable()
        if not entries:
            return
        wrs = []
        for e in entries:
            spec = e.payload
            assert isinstance(spec, RequestSpec)
            wrs.append(WorkRequest(e.wr_id, spec.opcode, spec.sges, spec.remote_addr, spec.rkey, e.signaled))
        self.qp.post_send(wrs)
        self.posted += len(wrs)
        self.max_in_flight = max(self.max_in_flight, len(self.sendq.in_flight))
        self._on_post()

    def on_completion(self, wc: WorkCompletion) -> None:
        for entry, status in self.sendq.complete(wc.wr_id, wc.status):
            vendor = wc.vendor_err if entry.wr_id == wc.wr_id else 0
            entry.owner._account(status, vendor, self.qp.qp_num)
        if self.sendq.failed:
            self.state = ChannelState.FAILED if self.state != ChannelState.CLOSED else self.state
            if not self.sendq.in_flight:
                self._settle_failed()
        else:
            self._pump()
        self._wake_idle()

    def _settle_failed(self) -> None:
        """The failed pair has drained: requests queued before the failure flush, in order."""
        for entry, status in self.sendq.flush_waiting():
            entry.owner._account(status, 0, self.qp.qp_num)

    def replace_qp(self, qp: QueuePair) -> None:
        """A reconnected pair takes over; waiting requests post on it."""
        self.qp = qp
        self.sendq.reset()
        self.state = ChannelState.READY
        self._pump()

    def fail_waiting(self, status: WcStatus = WcStatus.WR_FLUSH_ERR) -> list[Transfer]:
        """End every waiting (unposted) request; return the transfers touched."""
        touched = []
        while self.sendq.waiting:
            entry = self.sendq.waiting.popleft()
            entry.owner._account(status, 0, self.qp.qp_num)
            touched.append(entry.owner)
        self._wake_idle()
        return touched

    def force_fail_in_flight(self) -> None:
        """The backend will never report these (device gone): end them as flushed."""
        for entry, status in self.sendq.fail_all_in_flight(lambda i: WcStatus.WR_FLUSH_ERR):
            entry.owner._account(status, 0, self.qp.qp_num)
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
