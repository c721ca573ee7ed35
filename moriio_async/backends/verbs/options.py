"""``VerbsOptions``: what only the verbs backend reads (``IOEngineConfig(verbs=VerbsOptions(...))``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...core.faultplan import FaultPlan
from ...errors import InvalidArgument
from ..base import check_number

__all__ = ["VerbsOptions"]


@dataclass(frozen=True, slots=True)
class VerbsOptions:
    """The verbs backend's own settings, each checked here."""

    device: str | None = None
    """The RDMA device name (the first ACTIVE one when None)."""
    ib_port: int = 1
    gid_index: int | None = None
    """GID table index (the RoCE v2 IPv4-mapped entry when None)."""
    qp_timeout: int = 14
    """Local ACK timeout exponent (4.096 us * 2**n)."""
    retry_cnt: int = 6
    """Transport retries (at most 6: rxe treats 7 as retry forever)."""
    rnr_retry: int = 7
    flush_grace: float = 2.0
    """Seconds a pair in error may take to flush its requests before they are declared flushed."""
    extended_qp: bool = True
    """Post through extended-QP send ops where the provider has them (False: the classic post_send)."""
    fault_plan: FaultPlan | Mapping[str, Any] | str | bytes | None = None
    """Fault injection at the initiator: a ``FaultPlan``, its dict or its JSON (kept as a ``FaultPlan``)."""

    def __post_init__(self) -> None:
        if self.device is not None and not isinstance(self.device, str):
            raise InvalidArgument(f"VerbsOptions.device must be a device name, not {self.device!r}")
        check_number("VerbsOptions", "ib_port", self.ib_port, 1, 255)
        if self.gid_index is not None:
            check_number("VerbsOptions", "gid_index", self.gid_index, 0, 1 << 16)
        check_number("VerbsOptions", "qp_timeout", self.qp_timeout, 0, 31)
        check_number("VerbsOptions", "retry_cnt", self.retry_cnt, 0, 7)
        check_number("VerbsOptions", "rnr_retry", self.rnr_retry, 0, 7)
        check_number("VerbsOptions", "flush_grace", self.flush_grace, 0, 3600, whole=False)
        if not isinstance(self.extended_qp, bool):
            raise InvalidArgument(f"VerbsOptions.extended_qp must be a bool, not {self.extended_qp!r}")
        plan = self.fault_plan
        if isinstance(plan, str | bytes):
            plan = FaultPlan.loads(plan)
        elif isinstance(plan, Mapping):
            plan = FaultPlan.from_dict(plan)
        elif plan is not None and not isinstance(plan, FaultPlan):
            raise InvalidArgument(f"VerbsOptions.fault_plan must be a FaultPlan, its dict or JSON, not {plan!r}")
        object.__setattr__(self, "fault_plan", plan)  # frozen: the plan parsed once, here

    @property
    def plan(self) -> FaultPlan | None:
        """``fault_plan``, parsed."""
        assert self.fault_plan is None or isinstance(self.fault_plan, FaultPlan)
        return self.fault_plan
