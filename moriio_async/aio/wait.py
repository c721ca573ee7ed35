"""``waiting_for_transfer_complete``: one ``asyncio.wait`` with the deadline.

No polling, no task per transfer: the transfers' own futures go to a single
``asyncio.wait``. When it returns with some still pending, the completion
queues behind them are drained once more before anything is called a
timeout: a completion that reached the CQ just before the deadline is
reported as what it is (MoRI-IO's ``wait_all`` called those timeouts).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from ..errors import TransferError, TransferFailed, TransferTimeout
from .transfer import Transfer

__all__ = ["waiting_for_transfer_complete"]


async def waiting_for_transfer_complete(
    transfers: Iterable[Transfer] | Transfer,
    timeout: float | None = None,
    fail_fast: bool = False,
) -> None:
    """Wait until every transfer succeeded, or raise one ``TransferError`` for those that did not.

    ``timeout`` is seconds from now (None: no deadline). The error lists a
    ``TransferFailed`` per failed transfer and a ``TransferTimeout`` per
    transfer still pending at the deadline; timed-out transfers go on, and
    their buffers stay pinned until they end. With ``fail_fast`` the wait
    ends at the first failure, listing the failures only; if it reaches its
    deadline first, it lists the timed-out transfers too.
    """
    items = [transfers] if isinstance(transfers, Transfer) else list(dict.fromkeys(transfers))
    if not items:
        return
    pending = [t._future for t in items if not t.done()]
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    return_when = asyncio.FIRST_EXCEPTION if fail_fast else asyncio.ALL_COMPLETED
    # With fail_fast, a failure known before the wait began ends it at once, like one seen while waiting.
    ended_by_failure = fail_fast and any(t.error() is not None for t in items)
    while pending and not ended_by_failure:
        remaining = None if deadline is None else deadline - loop.time()
        if remaining is not None and remaining <= 0:
            break
        done, still = await asyncio.wait(pending, timeout=remaining, return_when=return_when)
        if fail_fast and any(f.exception() is not None for f in done):
            ended_by_failure = True
            break
        # A loop whose timers have millisecond resolution (uvloop) may wake a hair
        # early; going round again keeps the promise of no timeout before T.
        pending = list(still)
    if any(not t.done() for t in items):
        # One drain per completion router (per engine), however many of its transfers are pending.
        drainers = dict.fromkeys(d for t in items if not t.done() and (d := t.drainer) is not None)
        for drainer in drainers:
            drainer.drain()
    failed: list[TransferFailed] = [e for t in items if (e := t.error()) is not None]
    if ended_by_failure:
        raise TransferError.build(failed, [], len(items))
    # Past this point the wait ran to its deadline (or everything ended): a failure that only the
    # final drain found must not hide the transfers still pending, fail_fast or not.
    timed_out = [TransferTimeout(t.id, timeout or 0.0, peer=t.peer) for t in items if not t.done()]
    if failed or timed_out:
        raise TransferError.build(failed, timed_out, len(items))
