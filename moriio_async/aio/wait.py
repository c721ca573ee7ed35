"""``waiting_for_transfer_complete``: one waiter and one timer, whatever the number of transfers.

No polling and no task. The wait counts the transfers still pending and
registers a plain callback on each (``Transfer.add_done_callback`` runs
callbacks synchronously when the transfer ends: no loop handle per
transfer, unlike ``asyncio.wait``). The last one to end, or the first
failure under ``fail_fast``, resolves the wait's single future; the deadline
is one ``call_at`` timer. When the deadline comes with transfers still
pending, the completion queues behind them are drained once more before
anything is called a timeout: a completion that reached the CQ just before
the deadline is reported as what it is (MoRI-IO's ``wait_all`` called those
timeouts). The error's text is rendered only when someone reads it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from ..errors import TransferError, TransferFailed
from .transfer import Drainer, Transfer

__all__ = ["waiting_for_transfer_complete"]


class _Waiter:
    """Counts pending transfers down; wakes the one future when the wait may end."""

    __slots__ = ("closed", "deadline", "fail_fast", "failed", "future", "loop", "pending", "timer")

    def __init__(self, loop: asyncio.AbstractEventLoop, pending: int, fail_fast: bool, deadline: float | None) -> None:
        self.loop = loop
        self.future: asyncio.Future[None] = loop.create_future()
        self.pending = pending
        self.fail_fast = fail_fast
        self.failed: list[TransferFailed] = []
        self.closed = False
        self.deadline = deadline
        self.timer: asyncio.TimerHandle | None = None

    def arm(self) -> None:
        """Start the deadline timer. Called last, just before the wait sleeps: uvloop starts a timer
        from the time its loop iteration began, so work done after ``call_at`` in the same iteration
        would make the timer that much late (asyncio's timers are absolute either way)."""
        if self.deadline is not None:
            self.timer = self.loop.call_at(self.deadline, self.on_timer)

    def ended(self, t: Transfer) -> None:
        self.pending -= 1
        error = t.error()
        if error is not None:
            self.failed.append(error)
        if (self.pending == 0 or (self.fail_fast and error is not None)) and not self.future.done():
            self.future.set_result(None)

    def on_timer(self) -> None:
        assert self.deadline is not None
        remaining = self.deadline - self.loop.time()
        if remaining > 0:
            # uvloop's timers have millisecond resolution and may fire a hair early: no
            # transfer is called timed out before its deadline.
            self.timer = self.loop.call_later(remaining, self.on_timer)
        elif not self.future.done():
            self.future.set_result(None)

    def close(self) -> None:
        """The wait is over: transfers that end later tell nobody (no unregistering from each one)."""
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()


async def waiting_for_transfer_complete(
    transfers: Iterable[Transfer] | Transfer,
    timeout: float | None = None,
    fail_fast: bool = False,
) -> None:
    """Wait until every transfer succeeded, or raise one ``TransferError`` for those that did not.

    ``timeout`` is seconds from now (None: no deadline; 0: look once, now).
    The error lists a ``TransferFailed`` per failed transfer and a
    ``TransferTimeout`` per transfer still pending at the deadline; timed-out
    transfers go on, and their buffers stay pinned until they end. A
    transfer given twice counts once. With ``fail_fast`` the wait ends at the
    first failure, listing the failures only (those already in the completion
    queue when it ends included; a failure known before the call ends it at
    once, even with a timeout of 0); if it reaches its deadline first, it
    lists the timed-out transfers too.
    """
    loop = asyncio.get_running_loop()
    # The deadline counts from the call: sorting out thousands of transfers below is part of the wait.
    deadline = None if timeout is None else loop.time() + timeout
    items = [transfers] if isinstance(transfers, Transfer) else list(dict.fromkeys(transfers))
    if not items:
        return
    failed: list[TransferFailed] = []
    pending: list[Transfer] = []
    for t in items:
        if not t.done():
            pending.append(t)
        elif (error := t.error()) is not None:
            failed.append(error)
    # With fail_fast, a failure known before the wait began ends it at once, like one seen while waiting.
    ended_by_failure = fail_fast and bool(failed)
    left = len(pending)
    if pending and not ended_by_failure:
        waiter = _Waiter(loop, len(pending), fail_fast, deadline)
        for t in pending:
            t.watch(waiter)
        # Known now, not at the deadline: only the work after the deadline makes a timeout late.
        drainers = _drains(pending)
        try:
            if timeout is None or timeout > 0:
                waiter.arm()
                await waiter.future
            ended_by_failure = fail_fast and bool(waiter.failed)
            if waiter.pending:
                # However the wait ended (the deadline, or a failure under fail_fast), what the completion
                # queues already hold is reported as what it is, not as pending or timed out. The drain
                # runs the waiter's callback for each transfer it ends.
                for drainer in drainers:
                    drainer.drain()
        finally:
            waiter.close()
        left = waiter.pending
        failed += waiter.failed
        if len(failed) > 1:
            failed.sort(key=lambda e: e.transfer_id)
    if ended_by_failure:
        raise TransferError.build(failed, [], len(items))
    # Past this point the wait ran to its deadline (or everything ended): a failure that only the
    # final drain found must not hide the transfers still pending, fail_fast or not.
    # Whatever is still pending timed out: no per-transfer object is made here (the error makes its
    # TransferTimeout members when someone reads them), and when nothing ended, not even a new list.
    timed_out = [] if not left else pending if left == len(pending) else [t for t in pending if not t.done()]
    if failed or timed_out:
        raise TransferError.after_deadline(failed, timed_out, timeout or 0.0, len(items))


def _drains(pending: list[Transfer]) -> list[Drainer]:
    """One drain per completion router (per engine) behind the pending transfers, not one per transfer."""
    # Every router behind the list (one per engine), whether or not its transfers ended: a spare drain is cheap.
    return [d for d in dict.fromkeys(t.drainer for t in pending) if d is not None]
