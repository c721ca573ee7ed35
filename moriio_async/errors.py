"""The package's error tree. Backends map their library's exceptions onto it.

Every error may carry a ``hint``: one sentence saying what to do about it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .status import StatusCode, WcStatus

__all__ = [
    "AuthenticationError",
    "BackendUnavailable",
    "ControlPlaneError",
    "EngineClosed",
    "InvalidArgument",
    "MemoryInUse",
    "MoriioError",
    "PeerError",
    "SessionClosed",
    "StalePeer",
    "TransferError",
    "TransferFailed",
    "TransferTimeout",
]


class MoriioError(Exception):
    """Base of every error moriio_async raises on purpose."""

    hint: str | None = None

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        if hint is not None:
            self.hint = hint

    def __str__(self) -> str:
        text = super().__str__()
        return f"{text} (hint: {self.hint})" if self.hint else text


class InvalidArgument(MoriioError, ValueError):
    """Bad input: nothing was posted."""


class EngineClosed(MoriioError):
    """The engine was closed, or not started."""


class SessionClosed(MoriioError):
    """The session was closed."""


class MemoryInUse(MoriioError):
    """A region still has transfers in flight; freeing it would let the NIC write freed memory."""


class BackendUnavailable(MoriioError):
    """The chosen backend cannot run on this machine."""


class ControlPlaneError(MoriioError):
    """The handshake or a control message failed."""


class PeerError(ControlPlaneError):
    """The peer answered a control request with an error."""


class AuthenticationError(ControlPlaneError):
    """The hello failed: a proof of the shared secret did not verify, or only one side has a secret."""


class StalePeer(ControlPlaneError):
    """The peer restarted: descriptors of its earlier incarnation are void."""


class TransferFailed(MoriioError):
    """One transfer ended in failure."""

    def __init__(
        self,
        message: str,
        *,
        code: StatusCode = StatusCode.ERR_RDMA_OP,
        wc_status: WcStatus | None = None,
        vendor_err: int = 0,
        peer: str = "",
        qp_num: int | None = None,
        transfer_id: int = 0,
        local_offsets: Sequence[int] = (),
        remote_offsets: Sequence[int] = (),
        hint: str | None = None,
    ) -> None:
        super().__init__(message, hint=hint)
        self.message = message
        self.code = code
        self.wc_status = wc_status
        self.vendor_err = vendor_err
        self.peer = peer
        self.qp_num = qp_num
        self.transfer_id = transfer_id
        self.local_offsets = tuple(local_offsets)
        self.remote_offsets = tuple(remote_offsets)

    def line(self) -> str:
        """The one-line form used inside a ``TransferError``'s message."""
        return f"transfer {self.transfer_id}: RDMA transfer failed: {self.message} (code={int(self.code)})"


class TransferTimeout(MoriioError, TimeoutError):
    """A transfer was still pending when the caller's deadline passed. It goes on."""

    hint = (
        "raise the timeout (IOEngineConfig.transfer_timeout) or check the peer; "
        "the buffers stay pinned until the transfer ends or the session is aborted"
    )

    def __init__(self, transfer_id: int, timeout: float, *, peer: str = "") -> None:
        # OSError's own init is skipped on purpose: it would read (transfer_id, timeout) as
        # (errno, strerror). A wait may time out thousands at once, so nothing is formatted
        # until someone reads it.
        self.transfer_id = transfer_id
        self.timeout = timeout
        self.peer = peer

    def line(self) -> str:
        where = self.peer or "peer"
        return f"transfer {self.transfer_id}: timed out after {self.timeout:g}s (still in flight to {where})"

    def __str__(self) -> str:
        return f"{self.line()} (hint: {self.hint})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_timeout, (self.transfer_id, self.timeout, self.peer))


def _timeout(transfer_id: int, timeout: float, peer: str) -> TransferTimeout:
    return TransferTimeout(transfer_id, timeout, peer=peer)


class TransferError(MoriioError, ExceptionGroup):  # type: ignore[misc,unused-ignore]
    """Some transfers of a wait did not succeed: one member per failed or timed-out transfer."""

    def __new__(
        cls, message: str, exceptions: Sequence[TransferFailed | TransferTimeout], total: int = 0
    ) -> TransferError:
        return super().__new__(cls, message, list(exceptions))

    def __init__(self, message: str, exceptions: Sequence[TransferFailed | TransferTimeout], total: int = 0) -> None:
        # ExceptionGroup takes its args from __new__; MoriioError's __init__ is skipped on purpose.
        self.total = total

    @classmethod
    def build(cls, failed: Sequence[TransferFailed], timed_out: Sequence[TransferTimeout], total: int) -> TransferError:
        members: list[TransferFailed | TransferTimeout] = [*failed, *timed_out]
        return cls(f"{len(members)}/{total} transfers failed:", members, total)

    @property
    def failed(self) -> list[TransferFailed]:
        return [e for e in self.exceptions if isinstance(e, TransferFailed)]

    @property
    def timed_out(self) -> list[TransferTimeout]:
        return [e for e in self.exceptions if isinstance(e, TransferTimeout)]

    def derive(self, excs: Sequence[Any]) -> TransferError:  # type: ignore[override]
        return TransferError(self.message, excs, self.total)

    def __str__(self) -> str:
        """The head line, then one line per member; rendered when read, not when raised."""
        lines = (m.line() if isinstance(m, TransferFailed | TransferTimeout) else str(m) for m in self.exceptions)
        return "\n".join([str(self.message), *lines])
