"""``IOEngineSession``: MoRI-IO's session, striped over ``qp_per_transfer`` moriio_async sessions.

Each stripe is a moriio_async ``Session`` with its own queue pair between the
same two regions. A batch is checked and planned in the calling thread
(``plan.py``), then posted from the engine's loop thread; the status ends from
the loop's completion reader, through each transfer's done callback.

Order and failure, striped:

- Within one stripe, requests run and complete in posting order (RC queue
  pair semantics); across stripes there is no order, so two transfers that
  touch the same bytes need a wait between them, as with MoRI-IO.
- A striped status ends when every one of its posts has ended. It succeeds
  when all succeed; otherwise it carries the code and message of the first
  post to fail (in completion order). Waiting for all before reporting a
  failure means that when ``Wait()`` returns, no queue pair still touches
  the buffers.

With ``enable_notification`` (the default), a status that was posted tells
the target how it ended, once all its parts have (``announce``: the engine's
``done`` notice): MoRI-IO's target hears only of successes, this one of
failures too. A status refused before posting (bad input, no backend) is not
announced, as in MoRI-IO.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from moriio_async import EngineClosed, InvalidArgument, SessionClosed, StalePeer, Transfer
from moriio_async import Session as AsyncSession

from .config import RdmaBackendConfig
from .desc import MemoryDesc
from .enums import StatusCode
from .loop import LoopThread
from .plan import Part, check_blocks, plan_parts
from .status import TransferStatus
from .trace import TransferTrace


class SessionRuntime(Protocol):
    """What a session needs of its engine's runtime (``runtime.EngineRuntime``), handed down to it."""

    loop: LoopThread
    trace: TransferTrace | None

    def allocate_transfer_uid(self) -> int: ...

    def announce(self, peer: str, uid: int, code: StatusCode) -> None: ...

    def new_status(self) -> TransferStatus: ...

    def problem(self, remote_key: str | None = None) -> str | None: ...


__all__ = ["IOEngineSession", "StatusJoin", "code_for"]

SUCCESS_MESSAGE = "success"
"""MoRI-IO reports a completed transfer with ``ibv_wc_status_str(IBV_WC_SUCCESS)``."""


def code_for(exc: BaseException) -> StatusCode:
    """The status code a refused post reports."""
    if isinstance(exc, InvalidArgument):
        return StatusCode.ERR_INVALID_ARGS
    if isinstance(exc, SessionClosed | EngineClosed | StalePeer):
        return StatusCode.ERR_BAD_STATE
    return StatusCode.ERR_RDMA_OP


class StatusJoin:
    """Ends one status when all of its ``parts`` posts ended (loop thread only)."""

    __slots__ = ("_failure", "_on_end", "_remaining", "_status")

    def __init__(self, status: TransferStatus, parts: int, on_end: Callable[[StatusCode], None] | None) -> None:
        self._status = status
        self._remaining = parts
        self._failure: tuple[int, str] | None = None
        self._on_end = on_end

    def end(self, code: int, message: str) -> None:
        if code != StatusCode.SUCCESS and self._failure is None:
            self._failure = (code, message)
        self._remaining -= 1
        if self._remaining:
            return
        final = StatusCode(self._failure[0]) if self._failure is not None else StatusCode.SUCCESS
        if self._on_end is not None:
            self._on_end(final)  # announce before the status is visible: the target hears of it soonest
        if self._failure is not None:
            self._status.Update(*self._failure)
        else:
            self._status.Update(StatusCode.SUCCESS, SUCCESS_MESSAGE)

    def transfer_ended(self, transfer: Transfer) -> None:
        self.end(transfer.Code(), transfer.Message())


class IOEngineSession:
    """Transfers between one local and one remote region (MoRI-IO's ``IOEngineSession``).

    ``stripes`` (not in MoRI-IO) are the moriio_async sessions underneath, one
    queue pair each. ``transfer_uid`` is optional here (MoRI-IO requires it);
    without one, a fresh uid is allocated.
    """

    def __init__(
        self,
        runtime: SessionRuntime,
        local: MemoryDesc,
        remote: MemoryDesc,
        stripes: Sequence[AsyncSession],
        config: RdmaBackendConfig,
        owner: object = None,
    ) -> None:
        self.local = local
        self.remote = remote
        self.stripes = tuple(stripes)
        self.config = config
        self.closed = False
        self.owner = owner  # keeps the engine object alive while its sessions are used
        self._rt = runtime

    def __repr__(self) -> str:
        return f"<IOEngineSession {self.local.engine_key}#{self.local.id} -> {self.remote.engine_key}#{self.remote.id}>"

    def allocate_transfer_uid(self) -> int:
        return self._rt.allocate_transfer_uid()

    def read(self, local_offset: int, remote_offset: int, size: int, transfer_uid: int | None = None) -> TransferStatus:
        return self._submit(True, [local_offset], [remote_offset], [size], transfer_uid)

    def write(
        self, local_offset: int, remote_offset: int, size: int, transfer_uid: int | None = None
    ) -> TransferStatus:
        return self._submit(False, [local_offset], [remote_offset], [size], transfer_uid)

    def batch_read(
        self,
        local_offsets: Sequence[int],
        remote_offsets: Sequence[int],
        sizes: Sequence[int],
        transfer_uid: int | None = None,
    ) -> TransferStatus:
        return self._submit(True, local_offsets, remote_offsets, sizes, transfer_uid)

    def batch_write(
        self,
        local_offsets: Sequence[int],
        remote_offsets: Sequence[int],
        sizes: Sequence[int],
        transfer_uid: int | None = None,
    ) -> TransferStatus:
        return self._submit(False, local_offsets, remote_offsets, sizes, transfer_uid)

    def alive(self) -> bool:
        """Usable now: not closed, the engine open with a backend, and every stripe's ``Session.alive()``
        (its queue pair ready, its peer's control link open, the peer not restarted). MoRI-IO's ``Alive()``
        always answers true. Reads state only, so it is safe from any thread."""
        return not self.closed and self._rt.problem() is None and all(s.alive() for s in self.stripes)

    def close(self) -> None:
        """Abort what is in flight and destroy the queue pairs (not in MoRI-IO). Idempotent; blocks."""
        if not self.closed and self._rt.loop.running:
            self._rt.loop.run(self.aclose(), "IOEngineSession.close")

    async def aclose(self, drain_timeout: float | None = None) -> None:
        """Close every stripe; with ``drain_timeout``, first let what they carry end (up to that long)."""
        self.closed = True
        if drain_timeout is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(drain_timeout):
                    for stripe in self.stripes:
                        await stripe.drain()
        for stripe in self.stripes:
            await stripe.close()

    # -- posting ---------------------------------------------------------------------------------

    def _submit(
        self, read: bool, lo: Sequence[int], ro: Sequence[int], sz: Sequence[int], uid: int | None
    ) -> TransferStatus:
        t0 = time.monotonic()
        status = self._rt.new_status()
        uid = self._rt.allocate_transfer_uid() if uid is None else int(uid)
        problem = "session is closed" if self.closed else self._rt.problem()
        if problem is not None:
            status.Update(StatusCode.ERR_BAD_STATE, problem)
            return status
        checked = check_blocks(lo, ro, sz, self.local.size, self.remote.size)
        if isinstance(checked, str):
            status.Update(StatusCode.ERR_INVALID_ARGS, checked)
            return status
        parts = plan_parts(*checked, stripes=len(self.stripes), post_batch_size=self.config.post_batch_size, uid=uid)
        if not parts:  # MoRI-IO: an empty batch succeeds at once, and is announced like any other
            status.Update(StatusCode.SUCCESS, "")
            if self.config.enable_notification:
                self._rt.loop.post(self._rt.announce, self.remote.engine_key, uid, StatusCode.SUCCESS)
            return status
        status.SetCode(StatusCode.IN_PROGRESS)
        self._rt.loop.post(self.post_parts, read, parts, status, uid, t0)
        return status

    def post_blocks(
        self, read: bool, lo: list[int], ro: list[int], sz: list[int], uid: int, status: TransferStatus
    ) -> None:
        """Loop thread: plan checked blocks for this session's stripes and post them."""
        t0 = time.monotonic()
        parts = plan_parts(lo, ro, sz, stripes=len(self.stripes), post_batch_size=self.config.post_batch_size, uid=uid)
        if parts:
            self.post_parts(read, parts, status, uid, t0)
            return
        if self.config.enable_notification:
            self._rt.announce(self.remote.engine_key, uid, StatusCode.SUCCESS)
        status.Update(StatusCode.SUCCESS, "")

    def post_parts(self, read: bool, parts: list[Part], status: TransferStatus, uid: int, t0: float = 0.0) -> None:
        """Loop thread: post every part on its stripe; the status ends when all have ended."""
        peer = self.remote.engine_key
        notify = self.config.enable_notification
        trace = self._rt.trace
        on_end: Callable[[StatusCode], None] | None = None
        if notify or trace is not None:
            nbytes = sum(sum(p.sizes) for p in parts) if trace is not None else 0
            transport = self.stripes[0].transport

            def on_end(code: StatusCode) -> None:
                if notify:
                    self._rt.announce(peer, uid, code)
                if trace is not None:
                    op = "read" if read else "write"
                    trace.record(op=op, nbytes=nbytes, code=int(code), t0=t0, t1=time.monotonic(), transport=transport)

        join = StatusJoin(status, len(parts), on_end)
        for part in parts:
            stripe = self.stripes[part.stripe]
            post: Callable[..., Any] = stripe.batch_read if read else stripe.batch_write
            try:
                transfer: Transfer = post(part.local_offsets, part.remote_offsets, part.sizes)
            except Exception as exc:  # every refusal ends its part: a status never hangs
                join.end(code_for(exc), str(exc))
                continue
            transfer.add_done_callback(join.transfer_ended)
