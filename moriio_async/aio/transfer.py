"""A transfer: an awaitable that also answers MoRI-IO's ``TransferStatus`` questions.

No task and no future of its own: a transfer is a latch, and each ``await``
of one still running makes a waiter future that the transfer resolves
directly when it ends (one loop hop to the awaiting task, not the two of
``asyncio.shield``). The first terminal state is latched: once
``Succeeded()`` or ``Failed()`` is true, nothing changes it. Cancelling the
task that awaits a transfer cancels only its waiter, never the transfer: the
NIC would go on writing into the buffers either way.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Generator, Sequence
from typing import Any, NamedTuple, Protocol, final

import numpy as np
import numpy.typing as npt

from ..core.outcome import Outcome
from ..errors import TransferFailed
from ..status import Opcode, StatusCode, WcStatus

__all__ = ["Attached", "Drainer", "Transfer", "Watcher"]

_IN_PROGRESS = StatusCode.IN_PROGRESS
_SUCCESS = WcStatus.SUCCESS


class Attached(NamedTuple):
    """What a transfer holds for others right now (``Transfer.attached``)."""

    awaiters: int
    """Futures of ``wait()`` calls (done ones are pruned once 16 are held)."""
    watchers: int
    """Watchers of waits over many transfers (closed ones are pruned once 16 are held)."""
    callbacks: int
    """Done callbacks."""
    lists: int
    """Lists allocated to hold them: none until a second callback or the first waiter or watcher."""


class Watcher(Protocol):
    """Something waiting on many transfers at once (the deadline wait): told when each ends, until it closes."""

    closed: bool

    def ended(self, transfer: Transfer) -> None: ...


class Drainer(Protocol):
    """What a transfer's completions come back through (the engine's completion router)."""

    def drain(self) -> int:
        """Dispatch every completion already queued; how many there were."""
        ...


@final
class Transfer:
    """One read or write (single or batched) between a session's two regions."""

    __slots__ = (
        "_awaiters",
        "_code",
        "_done",
        "_drainer",
        "_error",
        "_first",
        "_lo",
        "_loop",
        "_message",
        "_on_end",
        "_outcome",
        "_remaining",
        "_ro",
        "_sz",
        "_watchers",
        "id",
        "opcode",
        "peer",
        "uid",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        transfer_id: int,
        opcode: Opcode,
        peer: str,
        local_offsets: Sequence[int] | npt.NDArray[np.int64],
        remote_offsets: Sequence[int] | npt.NDArray[np.int64],
        sizes: Sequence[int] | npt.NDArray[np.int64],
        drainer: Drainer | None = None,
        uid: int | None = None,
        on_end: Callable[[Transfer], None] | None = None,
    ) -> None:
        self.id = transfer_id
        self.uid = uid
        """The caller's transfer uid (announced to the target when the transfer ends), or None."""
        self.opcode = opcode
        self.peer = peer
        # Kept as given (arrays on the data path): tuples are made only if someone asks.
        self._lo = local_offsets
        self._ro = remote_offsets
        self._sz = sizes
        self._loop = loop
        self._done = False
        self._awaiters: list[asyncio.Future[None]] | None = None
        self._code = StatusCode.INIT
        self._message = ""
        self._error: TransferFailed | None = None
        self._outcome: Outcome | None = None
        self._remaining = 0
        self._drainer = drainer
        # Every transfer gets one done callback (its router's); lists only when more come. Thousands of
        # transfers in flight are thousands of objects the garbage collector walks on every full pass.
        self._first = on_end
        """The first done callback (``add_done_callback``'s, or the one given here)."""
        self._on_end: list[Callable[[Transfer], None]] | None = None
        self._watchers: list[Watcher] | None = None

    # -- MoRI-IO's TransferStatus surface -------------------------------------------------

    def Code(self) -> int:
        return int(self._code)

    def Message(self) -> str:
        return self._message

    def Init(self) -> bool:
        return self._code is StatusCode.INIT

    def InProgress(self) -> bool:
        return self._code is StatusCode.IN_PROGRESS

    def Succeeded(self) -> bool:
        return self._code is StatusCode.SUCCESS

    def Failed(self) -> bool:
        return self._code > 10

    # -- asyncio -----------------------------------------------------------------------------

    @property
    def code(self) -> StatusCode:
        return self._code

    @property
    def local_offsets(self) -> tuple[int, ...]:
        return _ints(self._lo)

    @property
    def remote_offsets(self) -> tuple[int, ...]:
        return _ints(self._ro)

    @property
    def sizes(self) -> tuple[int, ...]:
        return _ints(self._sz)

    @property
    def nbytes(self) -> int:
        sz = self._sz
        return int(sz.sum()) if isinstance(sz, np.ndarray) else sum(sz)

    @property
    def drainer(self) -> Drainer | None:
        """Where this transfer's completions come from (one per engine), for a last look before a timeout."""
        return self._drainer

    def done(self) -> bool:
        return self._done

    def error(self) -> TransferFailed | None:
        """The failure, once failed; None otherwise."""
        return self._error

    def __await__(self) -> Generator[Any, None, None]:
        if not self._done:
            waiter: asyncio.Future[None] = self._loop.create_future()
            awaiters = self._awaiters
            if awaiters is None:
                self._awaiters = [waiter]
            else:
                if len(awaiters) >= 16:
                    # Waits cancelled again and again (a timeout in a loop) leave done waiters behind.
                    awaiters[:] = [w for w in awaiters if not w.done()]
                awaiters.append(waiter)
            yield from waiter
        if self._error is not None:
            raise self._error

    async def wait(self, timeout: float | None = None) -> None:
        """Await with a deadline; ``TimeoutError`` leaves the transfer running."""
        async with asyncio.timeout(timeout):
            await self

    def add_done_callback(self, fn: Callable[[Transfer], None]) -> None:
        """Call ``fn(self)`` once the transfer ends (at once if it has)."""
        if self._done:
            fn(self)
        elif self._first is None and not self._on_end:
            self._first = fn
        elif self._on_end is None:
            self._on_end = [fn]
        else:
            self._on_end.append(fn)

    def remove_done_callback(self, fn: Callable[[Transfer], None]) -> None:
        """Forget ``fn`` if it has not run yet."""
        if self._first is not None and self._first == fn:
            self._first = None
        elif self._on_end:
            with contextlib.suppress(ValueError):
                self._on_end.remove(fn)

    def watch(self, watcher: Watcher) -> None:
        """Call ``watcher.ended(self)`` when the transfer ends (at once if it has), unless the watcher closed.

        A wait over thousands of transfers closes its watcher at the deadline instead of unregistering
        from each one; closed watchers are dropped here as new ones come, so waiting again and again on
        a transfer that never ends keeps a bounded list.
        """
        if self._done:
            watcher.ended(self)
            return
        watchers = self._watchers
        if watchers is None:
            self._watchers = [watcher]
            return
        if len(watchers) >= 16:
            # In place: a new list per transfer, for thousands of transfers, is thousands of long-lived
            # objects, which bring on the full garbage collections a deadline cannot afford.
            watchers[:] = [w for w in watchers if not w.closed]
        watchers.append(watcher)

    def attached(self) -> Attached:
        """What this transfer holds for others: a loop that waits again and again, or thousands of
        transfers in flight, must keep these bounded (the tests check it here)."""
        lists = sum(x is not None for x in (self._awaiters, self._on_end, self._watchers))
        callbacks = (self._first is not None) + len(self._on_end or ())
        return Attached(len(self._awaiters or ()), len(self._watchers or ()), callbacks, lists)

    def __repr__(self) -> str:
        return f"<Transfer {self.id} {self.opcode.name} {self.nbytes}B to {self.peer} {self._code.name}>"

    # -- runtime side: called by the queue-pair channel and the session, never by users ----------

    def start(self, n_requests: int) -> None:
        """Posted (or queued to post) as ``n_requests`` work requests."""
        self._remaining = n_requests
        self._outcome = None
        self._code = _IN_PROGRESS

    def settle(self, count: int, status: WcStatus, vendor_err: int = 0, qp_num: int | None = None) -> None:
        """``count`` of its work requests ended with ``status``; the last ones end the transfer."""
        if self._code is not _IN_PROGRESS:
            return  # not started, or ended already (latched)
        outcome = self._outcome
        if outcome is None:
            # Successes only so far: a count is all there is to fold (an ``Outcome`` once one fails).
            if status is _SUCCESS:
                remaining = self._remaining - count
                if remaining > 0:
                    self._remaining = remaining
                elif remaining == 0:
                    self._remaining = 0
                    self._finish(StatusCode.SUCCESS, "")
                else:
                    raise RuntimeError("more completions than work requests")
                return
            outcome = self._outcome = Outcome(self._remaining)
        if outcome.add(count, status, vendor_err, qp_num):
            if outcome.wc_status is WcStatus.SUCCESS:
                self._finish(StatusCode.SUCCESS, "")
            else:
                self._finish(
                    outcome.code,
                    outcome.message(),
                    wc_status=outcome.wc_status,
                    vendor_err=outcome.vendor_err,
                    qp_num=outcome.qp_num,
                )

    def fail(self, code: StatusCode, message: str, hint: str | None = None) -> None:
        """End without a completion (e.g. the peer restarted before anything was posted)."""
        self._finish(code, message, hint=hint)

    def _finish(
        self,
        code: StatusCode,
        message: str,
        *,
        wc_status: WcStatus | None = None,
        vendor_err: int = 0,
        qp_num: int | None = None,
        hint: str | None = None,
    ) -> None:
        if self._done:
            return  # latched: the first terminal state stands
        self._done = True
        self._code = code
        self._message = message
        if code is not StatusCode.SUCCESS:
            # Kept, not set on a future: not awaiting a failed transfer is legitimate (MoRI-IO style,
            # the status surface reports it), so there is no "exception never retrieved" to silence.
            self._error = TransferFailed(
                message,
                code=code,
                wc_status=wc_status,
                vendor_err=vendor_err,
                peer=self.peer,
                qp_num=qp_num,
                transfer_id=self.id,
                local_offsets=self.local_offsets,
                remote_offsets=self.remote_offsets,
                hint=hint,
            )
        if self._awaiters:
            awaiters, self._awaiters = self._awaiters, None
            for waiter in awaiters:
                if not waiter.done():  # a cancelled wait
                    waiter.set_result(None)
        first, self._first = self._first, None
        if first is not None:
            first(self)
        if self._on_end:
            callbacks, self._on_end = self._on_end, None
            for fn in callbacks:
                fn(self)
        if self._watchers:
            watchers, self._watchers = self._watchers, None
            for w in watchers:
                if not w.closed:
                    w.ended(self)


def _ints(values: Sequence[int] | npt.NDArray[np.int64]) -> tuple[int, ...]:
    return tuple(values.tolist()) if isinstance(values, np.ndarray) else tuple(values)
