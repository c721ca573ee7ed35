"""Each backend's own settings, as frozen dataclasses checked when they are made.

``IOEngineConfig(tcp=TcpOptions(...), verbs=VerbsOptions(...), cma=CmaOptions(...), mock=MockOptions(...))``
hands each backend its own in ``BackendOptions.specific``. They live here, beside the contract, not in the
backends' packages: the engine's config imports them, and importing a backend package imports the whole
backend (``import moriio_async`` would then load every backend). The two fields that hold a backend's own
objects (``TcpOptions.hooks``, ``MockOptions.fabric``) are checked by that backend when it opens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..core.faultplan import FaultPlan
from ..errors import InvalidArgument
from .base import check_number

__all__ = ["PTRACER_POLICIES", "CmaOptions", "MockOptions", "TcpOptions", "VerbsOptions"]

PTRACER_POLICIES = ("peer", "any", "off")
"""``CmaOptions.ptracer``'s values (see ``backends/cma/permissions.py``)."""


@dataclass(frozen=True, slots=True)
class TcpOptions:
    """The tcp backend's own settings, each checked here."""

    max_data_hellos: int = 64
    """Data connections allowed in their hello (token not yet checked) at once; one more closes the oldest
    one in its hello, a silent one first (counted in ``statistics().data_plane["evicted_hellos"]``)."""
    max_data_hellos_per_address: int = 32
    """Of those, from one remote address (the oldest from there that had half its deadline makes room)."""
    reactor_threads: int = 0
    """Threads that serve the accepted data connections, each a share of them (readiness-driven: the number
    does not grow with the peers); 0: one per core, at most 4. More than one lets the kernel's socket copies of
    different peers run on different cores."""
    hooks: object = None
    """Fault injection: a ``backends.tcp.Hooks`` the NIC threads call (its type is checked at open: this
    module imports no backend)."""
    fault_plan: FaultPlan | None = None
    """Fault injection: a plan the initiator applies (``PlanHooks``); not with ``hooks``."""

    def __post_init__(self) -> None:
        for name in ("max_data_hellos", "max_data_hellos_per_address"):
            check_number("TcpOptions", name, getattr(self, name), 1, 1 << 20)
        check_number("TcpOptions", "reactor_threads", self.reactor_threads, 0, 64)
        if self.hooks is not None and self.fault_plan is not None:
            raise InvalidArgument("TcpOptions takes hooks or fault_plan, not both")
        if self.fault_plan is not None and not isinstance(self.fault_plan, FaultPlan):
            raise InvalidArgument(f"TcpOptions.fault_plan must be a FaultPlan, not {type(self.fault_plan).__name__}")


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
    fault_plan: FaultPlan | Mapping[str, object] | str | bytes | None = None
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


@dataclass(frozen=True, slots=True)
class CmaOptions:
    """The cma backend's own settings: how its queue pairs move bytes, and the target's permissions."""

    round_bytes: int = 16 << 20
    """Bytes moved per window under the copy lock (a chunk of requests, or a piece of a huge one)."""
    threads: int = 1
    """Threads one window is split over (1: the worker alone)."""
    split_bytes: int = 1 << 20
    """Windows smaller than this are not split."""
    inline_bytes: int = 1 << 20
    """A batch of at most this many bytes posted to an idle queue pair (nothing in flight, every earlier
    completion polled) is copied by the posting thread, the event loop, before ``post`` returns: no
    thread hand-off either way, at the price of the copy's time on the loop (about 0.1-0.2 ms per MiB).
    Larger batches, and any posted while others are in flight, go to the pair's worker. 0: always the worker.
    Why only 1 MiB by default: copies on the loop are serial, so a loop posting to several idle pairs at once
    (a decode engine reading from several prefill peers) would copy one after another what the pairs'
    workers copy side by side, and a longer copy delays every other callback of the loop by as much."""
    revoke_wait: float = 0.1
    """Seconds a deregistration waits at most for initiators to drop the region (then revoked anyway)."""
    ptracer: str = "peer"
    """Yama scope 1: "peer" names each initiator as this target's ptracer, "any" allows any same-uid
    process (logged once), "off" sets nothing."""
    quiet_refusal: bool = False
    """A refused attach is not logged by the backend (the engine, having a fallback, says it once)."""

    def __post_init__(self) -> None:
        check_number("CmaOptions", "round_bytes", self.round_bytes, 64 << 10, 1 << 30)
        check_number("CmaOptions", "threads", self.threads, 1, 64)
        check_number("CmaOptions", "split_bytes", self.split_bytes, 4 << 10, 1 << 30)
        check_number("CmaOptions", "inline_bytes", self.inline_bytes, 0, 1 << 30)
        if (
            not isinstance(self.revoke_wait, int | float)
            or isinstance(self.revoke_wait, bool)
            or not (0 < self.revoke_wait <= 60)
        ):
            raise InvalidArgument(f"CmaOptions.revoke_wait must be seconds in (0, 60], not {self.revoke_wait!r}")
        if self.ptracer not in PTRACER_POLICIES:
            raise InvalidArgument(f"CmaOptions.ptracer must be one of {PTRACER_POLICIES}, not {self.ptracer!r}")
        if not isinstance(self.quiet_refusal, bool):
            raise InvalidArgument(f"CmaOptions.quiet_refusal must be a bool, not {self.quiet_refusal!r}")


@dataclass(frozen=True, slots=True)
class MockOptions:
    """The mock backend's own settings."""

    hold: bool = False
    """The NIC runs a request only when the test says so (``MockQueuePair.step``, ``fail_next``, ``vanish``)."""
    silent_cq: bool = False
    """Completion queues raise no wakeup (the engine must ``drain_completions``)."""
    fabric: object = None
    """The ``backends.mock.MockFabric`` of the engines that can reach each other (checked at open); None: the
    process-wide default one."""

    def __post_init__(self) -> None:
        for name in ("hold", "silent_cq"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgument(f"MockOptions.{name} must be a bool, not {getattr(self, name)!r}")
