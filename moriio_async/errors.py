"""The package's error tree. Backends map their library's exceptions onto it.

Every error may carry a ``hint``: one sentence saying what to do about it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, cast

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
    "TimedOut",
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
        """MoRI-IO's code the transfer ended with (a failure: above 10)."""
        self.wc_status = wc_status
        """The status of the work completion that reported the failure; None when none did."""
        self.vendor_err = vendor_err
        """That completion's vendor error: the device's (``ibv_wc.vendor_err``), or a software NIC's own (0: none)."""
        self.peer = peer
        """The key of the engine at the other end."""
        self.qp_num = qp_num
        """The queue pair the failure was reported on; None when none was."""
        self.transfer_id = transfer_id
        self.local_offsets = tuple(local_offsets)
        self.remote_offsets = tuple(remote_offsets)
        """The transfer's blocks: their offsets in the local region and in the remote one."""

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


class Pending(Protocol):
    """A transfer as a timeout names it (``Transfer`` is one)."""

    @property
    def id(self) -> int: ...

    @property
    def peer(self) -> str: ...


class _Named(NamedTuple):
    id: int
    peer: str


class TimedOut(TransferTimeout):
    """Inside a ``TransferError``: every transfer a wait left pending, one ``TransferTimeout`` each once read.

    A wait over 10,000 transfers that reaches its deadline would otherwise build 10,000 exception
    objects before the caller hears of it (milliseconds, and enough long-lived objects to bring on a
    full garbage collection). This one member stands for all of them in the exception group's own
    tuple, which ``except*`` and the interpreter's re-raise logic read; ``TransferError.exceptions``,
    ``timed_out`` and ``str`` show the individual members, made on first read and kept.
    """

    def __init__(self, transfers: Sequence[Pending], timeout: float) -> None:
        first = transfers[0]
        super().__init__(first.id, timeout, peer=first.peer)
        self.args = (first.id, timeout)  # not the transfers: args outlive the expansion below
        self._transfers: Sequence[Pending] | None = transfers
        self._count = len(transfers)
        self._members: tuple[TransferTimeout, ...] | None = None

    def __len__(self) -> int:
        return self._count

    def members(self) -> tuple[TransferTimeout, ...]:
        """One ``TransferTimeout`` per transfer, in the wait's order (the same objects on every call)."""
        if self._members is None:
            assert self._transfers is not None
            timeout = self.timeout
            self._members = tuple(TransferTimeout(t.id, timeout, peer=t.peer) for t in self._transfers)
            self._transfers = None  # the transfers themselves are not kept alive by an error someone holds
        return self._members

    def line(self) -> str:
        return "\n".join(m.line() for m in self.members())

    def __str__(self) -> str:
        return f"{self._count} transfers timed out after {self.timeout:g}s, the first {self.transfer_id}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (TimedOut, ([_Named(m.transfer_id, m.peer) for m in self.members()], self.timeout))


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

    @classmethod
    def after_deadline(
        cls, failed: Sequence[TransferFailed], pending: Sequence[Pending], timeout: float, total: int
    ) -> TransferError:
        """``failed``, then a ``TransferTimeout`` for each of ``pending``, made when first read (O(1) now)."""
        members: list[TransferFailed | TransferTimeout] = [*failed]
        if pending:
            members.append(TimedOut(pending, timeout))
        return cls(f"{len(failed) + len(pending)}/{total} transfers failed:", members, total)

    @property
    def exceptions(self) -> tuple[TransferFailed | TransferTimeout, ...]:
        """One member per failed or timed-out transfer."""
        members: tuple[TransferFailed | TransferTimeout, ...] | None = self.__dict__.get("_members")
        if members is None:
            own: tuple[Any, ...] = super().exceptions
            if any(type(m) is TimedOut for m in own):
                members = tuple(x for m in own for x in (m.members() if type(m) is TimedOut else (m,)))
            else:
                members = own
            self.__dict__["_members"] = members
        return members

    def split(self, condition: Any) -> tuple[TransferError | None, TransferError | None]:  # type: ignore[override]
        # A type (what ``except*`` passes) matches the stand-in as it matches every TransferTimeout;
        # a predicate must see the individual members.
        if _predicate(condition) and self._stands_in():
            return self._expanded().split(condition)
        return super().split(condition)

    def subgroup(self, condition: Any) -> TransferError | None:  # type: ignore[override]
        if _predicate(condition) and self._stands_in():
            return self._expanded().subgroup(condition)
        return cast("TransferError | None", super().subgroup(condition))

    def _stands_in(self) -> bool:
        return any(type(m) is TimedOut for m in super().exceptions)

    def _expanded(self) -> TransferError:
        """The same group with its members spelled out (and the same traceback, cause and context)."""
        group = TransferError(self.message, self.exceptions, self.total)
        group.__traceback__, group.__cause__, group.__context__ = self.__traceback__, self.__cause__, self.__context__
        if hasattr(self, "__notes__"):
            group.__notes__ = list(self.__notes__)
        return group

    @property
    def failed(self) -> list[TransferFailed]:
        return [e for e in super().exceptions if isinstance(e, TransferFailed)]

    @property
    def timed_out(self) -> list[TransferTimeout]:
        return [e for e in self.exceptions if isinstance(e, TransferTimeout)]

    def derive(self, excs: Sequence[Any]) -> TransferError:  # type: ignore[override]
        return TransferError(self.message, excs, self.total)

    def __str__(self) -> str:
        """The head line, then one line per member; rendered when read, not when raised."""
        lines = (m.line() if isinstance(m, TransferFailed | TransferTimeout) else str(m) for m in self.exceptions)
        return "\n".join([str(self.message), *lines])


def _predicate(condition: Any) -> bool:
    """True for a callable condition that is not an exception type (nor a tuple of them)."""
    return callable(condition) and not isinstance(condition, type)
