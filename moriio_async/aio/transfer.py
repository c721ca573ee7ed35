"""A transfer: an awaitable that also answers MoRI-IO's ``TransferStatus`` questions.

One future per transfer, created here and nowhere else; no task. The first
terminal state is latched: once ``Succeeded()`` or ``Failed()`` is true,
nothing changes it. Awaiting goes through ``asyncio.shield`` because
cancelling the task that awaits a transfer must stop the waiting, never the
transfer: the NIC would go on writing into the buffers either way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator, Sequence
from typing import Any, Protocol, final

from ..core.outcome import Outcome
from ..errors import TransferFailed
from ..status import Opcode, StatusCode, WcStatus

__all__ = ["Drainer", "Transfer"]


class Drainer(Protocol):
    """What a transfer's completions come back through (the engine's completion router)."""

    def drain(self) -> int:
        """Dispatch every completion already queued; how many there were."""
        ...


@final
class Transfer:
    """One read or write (single or batched) between a session's two regions."""

    __slots__ = (
        "_code",
        "_drainer",
        "_error",
        "_future",
        "_message",
        "_on_end",
        "_outcome",
        "id",
        "local_offsets",
        "opcode",
        "peer",
        "remote_offsets",
        "sizes",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        transfer_id: int,
        opcode: Opcode,
        peer: str,
        local_offsets: Sequence[int],
        remote_offsets: Sequence[int],
        sizes: Sequence[int],
        *,
        drainer: Drainer | None = None,
    ) -> None:
        self.id = transfer_id
        self.opcode = opcode
        self.peer = peer
        self.local_offsets = tuple(local_offsets)
        self.remote_offsets = tuple(remote_offsets)
        self.sizes = tuple(sizes)
        self._future: asyncio.Future[None] = loop.create_future()
        self._code = StatusCode.INIT
        self._message = ""
        self._error: TransferFailed | None = None
        self._outcome: Outcome | None = None
        self._drainer = drainer
        self._on_end: list[Callable[[Transfer], None]] = []

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
    def nbytes(self) -> int:
        return sum(self.sizes)

    @property
    def drainer(self) -> Drainer | None:
        """Where this transfer's completions come from (one per engine), for a last look before a timeout."""
        return self._drainer

    def done(self) -> bool:
        return self._future.done()

    def error(self) -> TransferFailed | None:
        """The failure, once failed; None otherwise."""
        return self._error

    def __await__(self) -> Generator[Any, None, None]:
        return asyncio.shield(self._future).__await__()

    async def wait(self, timeout: float | None = None) -> None:
        """Await with a deadline; ``TimeoutError`` leaves the transfer running."""
        async with asyncio.timeout(timeout):
            await self

    def add_done_callback(self, fn: Callable[[Transfer], None]) -> None:
        """Call ``fn(self)`` once the transfer ends (at once if it has)."""
        if self._future.done():
            fn(self)
        else:
            self._on_end.append(fn)

    def __repr__(self) -> str:
        return f"<Transfer {self.id} {self.opcode.name} {self.nbytes}B to {self.peer} {self._code.name}>"

    # -- runtime side --------------------------------------------------------------------------

    def _start(self, n_requests: int) -> None:
        """Posted (or queued to post) as ``n_requests`` work requests."""
        self._outcome = Outcome(n_requests)
        self._code = StatusCode.IN_PROGRESS

    def _account(self, status: WcStatus, vendor_err: int = 0, qp_num: int | None = None) -> None:
        """One work request ended; the last one ends the transfer."""
        outcome = self._outcome
        if outcome is None or self._future.done():
            return
        if outcome.add(status, vendor_err, qp_num):
            if outcome.code is StatusCode.SUCCESS:
                self._finish(StatusCode.SUCCESS, "")
            else:
                self._finish(
                    outcome.code,
                    outcome.message(),
                    wc_status=outcome.wc_status,
                    vendor_err=outcome.vendor_err,
                    qp_num=outcome.qp_num,
                )

    def _fail(self, code: StatusCode, message: str, hint: str | None = None) -> None:
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
        if self._future.done():
            return  # latched: the first terminal state stands
        self._code = code
        self._message = message
        if code is StatusCode.SUCCESS:
            self._future.set_result(None)
        else:
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
            self._future.set_exception(self._error)
            # The status surface reports the failure too, so not awaiting a failed
            # transfer is legitimate (MoRI-IO style): mark the exception retrieved.
            self._future.exception()
        callbacks, self._on_end = self._on_end, []
        for fn in callbacks:
            fn(self)
