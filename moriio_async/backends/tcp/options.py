"""``TcpOptions``: what only the tcp backend reads (``IOEngineConfig(tcp=TcpOptions(...))``)."""

from __future__ import annotations

from dataclasses import dataclass

from ...core.faultplan import FaultPlan
from ...errors import InvalidArgument
from ..base import check_number
from .hooks import Hooks

__all__ = ["TcpOptions"]


@dataclass(frozen=True, slots=True)
class TcpOptions:
    """The tcp backend's own settings, each checked here."""

    max_data_hellos: int = 64
    """Data connections allowed in their hello (token not yet checked) at once; one more closes the oldest
    one in its hello, a silent one first (counted in ``statistics().data_plane["evicted_hellos"]``)."""
    max_data_hellos_per_address: int = 32
    """Of those, from one remote address (the oldest from there that had half its deadline makes room)."""
    hooks: Hooks | None = None
    """Fault injection: hooks the initiator's NIC threads call (see ``backends.tcp.hooks``)."""
    fault_plan: FaultPlan | None = None
    """Fault injection: a plan the initiator applies (``PlanHooks``); not with ``hooks``."""

    def __post_init__(self) -> None:
        for name in ("max_data_hellos", "max_data_hellos_per_address"):
            check_number("TcpOptions", name, getattr(self, name), 1, 1 << 20)
        if self.hooks is not None and self.fault_plan is not None:
            raise InvalidArgument("TcpOptions takes hooks or fault_plan, not both")
        if self.fault_plan is not None and not isinstance(self.fault_plan, FaultPlan):
            raise InvalidArgument(f"TcpOptions.fault_plan must be a FaultPlan, not {type(self.fault_plan).__name__}")
        if self.hooks is not None and not isinstance(self.hooks, Hooks):
            raise InvalidArgument(f"TcpOptions.hooks must be a tcp Hooks, not {type(self.hooks).__name__}")
