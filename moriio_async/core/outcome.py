"""Folding the completions of a transfer's work requests into one outcome.

A transfer is done when every one of its requests has been accounted for,
because until then the NIC may still touch its buffers. Its status is the
first failure seen, except that a root cause (any error but a flush) beats a
flush that was reported first by another queue pair.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..status import StatusCode, WcStatus

__all__ = ["Outcome", "describe_wc_status"]

_HINTS = {
    WcStatus.REM_ACCESS_ERR: "the peer rejected the access: wrong rkey, range outside its region, "
    "missing access rights, or the region was deregistered",
    WcStatus.LOC_PROT_ERR: "a local buffer is not inside a live registered region",
    WcStatus.RETRY_EXC_ERR: "the peer stopped answering (dead process, link down, or lost packets)",
    WcStatus.WR_FLUSH_ERR: "flushed: the queue pair was in the error state (an earlier failure or an abort)",
}


def describe_wc_status(status: WcStatus) -> str:
    """The status name with a short reason, for messages."""
    reason = _HINTS.get(status)
    return f"{status.name}: {reason}" if reason else status.name


@dataclass(slots=True)
class Outcome:
    """Running fold of one transfer's request completions."""

    remaining: int
    wc_status: WcStatus = WcStatus.SUCCESS
    vendor_err: int = 0
    qp_num: int | None = None

    def add(self, count: int, status: WcStatus, vendor_err: int = 0, qp_num: int | None = None) -> bool:
        """Account ``count`` requests that ended with ``status``; True when they were the last ones."""
        if count > self.remaining:
            raise RuntimeError("more completions than work requests")
        self.remaining -= count
        if status is not WcStatus.SUCCESS and (
            self.wc_status is WcStatus.SUCCESS
            or (self.wc_status is WcStatus.WR_FLUSH_ERR and status is not WcStatus.WR_FLUSH_ERR)
        ):
            self.wc_status, self.vendor_err, self.qp_num = status, vendor_err, qp_num
        return self.remaining == 0

    @property
    def code(self) -> StatusCode:
        return StatusCode.SUCCESS if self.wc_status is WcStatus.SUCCESS else StatusCode.ERR_RDMA_OP

    def message(self) -> str:
        if self.wc_status is WcStatus.SUCCESS:
            return ""
        qp = f", qp {self.qp_num}" if self.qp_num is not None else ""
        return (
            f"{describe_wc_status(self.wc_status)} (wc status {int(self.wc_status)}, vendor_err {self.vendor_err}{qp})"
        )
