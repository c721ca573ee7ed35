"""Work requests and work completions: the verbs-shaped values every backend speaks.

These mirror ``ibv_sge``, ``ibv_send_wr`` and ``ibv_wc`` closely enough that the
verbs backend translates them field by field, and the TCP backend emulates the
same contract.
"""

from __future__ import annotations

from dataclasses import dataclass

from .status import Opcode, WcStatus

__all__ = ["Sge", "WorkCompletion", "WorkRequest"]


@dataclass(frozen=True, slots=True)
class Sge:
    """One scatter/gather entry: ``length`` bytes at ``addr`` of the local region ``lkey``."""

    addr: int
    length: int
    lkey: int


@dataclass(frozen=True, slots=True)
class WorkRequest:
    """One RDMA READ or WRITE between a local scatter list and one remote range.

    ``signaled`` asks for a completion on success; a failed or flushed request
    always completes, signaled or not, so nothing posted is ever lost.
    """

    wr_id: int
    opcode: Opcode
    sges: tuple[Sge, ...]
    remote_addr: int
    rkey: int
    signaled: bool = True

    @property
    def length(self) -> int:
        return sum(s.length for s in self.sges)


@dataclass(frozen=True, slots=True)
class WorkCompletion:
    """What a completion queue reports for one work request."""

    wr_id: int
    status: WcStatus
    opcode: Opcode
    byte_len: int
    qp_num: int
    vendor_err: int = 0

    @property
    def ok(self) -> bool:
        return self.status is WcStatus.SUCCESS
