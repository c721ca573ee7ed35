"""Applying a ``FaultPlan`` at the TCP backend's seams (``hooks.py``).

Give a backend a plan with ``TcpOptions(fault_plan=plan)``
(``IOEngineConfig(tcp=...)``), or give it ``TcpOptions(hooks=PlanHooks(plan))``
to keep the hooks: ``applied`` lists what fired, ``release()`` ends stalls and
delays. The hooks run on the backend's NIC threads, never on an event loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import final

from ...core.faultplan import Action, Applied, FaultPlan, FaultRule
from ...errors import InvalidArgument
from ...status import WcStatus
from ...work import WorkRequest
from ..options import TcpOptions
from .hooks import Fault, Hooks

__all__ = ["PlanHooks", "hooks_from"]


@dataclass(slots=True)
class _Counter:
    """Pair numbers in order of first sight, and requests seen per pair."""

    pairs: dict[int, int] = field(default_factory=dict)
    requests: dict[int, int] = field(default_factory=dict)

    def next(self, qp_num: int) -> tuple[int, int]:
        qp = self.pairs.setdefault(qp_num, len(self.pairs))
        wr = self.requests.get(qp_num, 0)
        self.requests[qp_num] = wr + 1
        return qp, wr


@final
class PlanHooks(Hooks):
    """Applies a ``FaultPlan`` at the TCP backend's seams. Use one instance per backend.

    ``on_kill`` is what a ``kill`` rule calls; a plan with kill rules is
    refused without it, so a test process never kills itself by accident.
    ``release()`` ends every stall and delay, present and future; call it
    before closing a backend whose NIC threads may be held by one (closing a
    queue pair joins them).
    """

    def __init__(
        self,
        plan: FaultPlan,
        *,
        on_kill: Callable[[], None] | None = None,
        sleep: Callable[[float], None] | None = None,
    ) -> None:
        if plan.kills and on_kill is None:
            raise InvalidArgument(
                "this fault plan kills the target process: run it with `moriio-async faults`, "
                "which gives the target a process of its own"
            )
        self.plan = plan
        self._on_kill = on_kill
        self._lock = threading.Lock()
        self._released = threading.Event()
        self._sleep = sleep if sleep is not None else self._released.wait
        self._sent = _Counter()
        self._served = _Counter()
        self._positions: dict[tuple[int, int], tuple[int, int]] = {}
        self._applied: list[Applied] = []

    @property
    def applied(self) -> list[Applied]:
        """Every rule that fired, in the order it fired."""
        with self._lock:
            return list(self._applied)

    def release(self) -> None:
        self._released.set()

    def _match(self, qp: int, wr: int, actions: Iterable[Action]) -> FaultRule | None:
        wanted = set(actions)
        return next((r for r in self.plan.rules if r.action in wanted and r.matches(qp, wr)), None)

    def _record(self, rule: FaultRule, qp: int, wr: int, detail: str = "") -> None:
        with self._lock:
            self._applied.append(Applied(rule.action, qp, wr, detail))

    # -- the seams (NIC threads) ---------------------------------------------------------

    def on_send(self, qp_num: int, wr: WorkRequest) -> WcStatus | Fault | None:
        with self._lock:
            qp, n = self._sent.next(qp_num)
        if self._match(qp, n, (Action.DELAY,)) is not None:
            # Kept only for the requests a delay rule will hold back: a request flushed before its
            # response would otherwise leave its entry here for good (a soak of millions grows).
            with self._lock:
                self._positions[qp_num, wr.wr_id] = (qp, n)
        rule = self._match(qp, n, (Action.DROP, Action.STATUS))
        if rule is None:
            return None
        if rule.action is Action.DROP:
            self._record(rule, qp, n)
            return Fault.DROP
        self._record(rule, qp, n, rule.status.name)
        return rule.status

    def on_response(self, qp_num: int, wr: WorkRequest, status: WcStatus) -> WcStatus | Fault | None:
        with self._lock:
            where = self._positions.pop((qp_num, wr.wr_id), None)
        if where is None:
            return None
        rule = self._match(*where, (Action.DELAY,))
        if rule is not None:
            self._record(rule, *where, f"{rule.seconds:g}s")
            self._sleep(rule.seconds)
        return None

    def on_request(self, qp_num: int, opcode: int, rkey: int, remote_addr: int, length: int) -> Fault | None:
        with self._lock:
            qp, n = self._served.next(qp_num)
        rule = self._match(qp, n, (Action.STALL, Action.KILL))
        if rule is None:
            return None
        if rule.action is Action.KILL:
            self._record(rule, qp, n)
            assert self._on_kill is not None
            self._on_kill()
            return Fault.DROP  # on_kill returned: the closest thing left is a dead connection
        self._record(rule, qp, n, f"{rule.seconds:g}s" if rule.seconds else "until released")
        self._released.wait(rule.seconds or None)
        return None


def hooks_from(options: TcpOptions) -> Hooks | None:
    """The hooks ``TcpOptions`` asks for: its ``hooks``, or ``PlanHooks`` applying its ``fault_plan``."""
    if options.fault_plan is not None:
        return PlanHooks(options.fault_plan)
    if options.hooks is not None and not isinstance(options.hooks, Hooks):
        raise InvalidArgument(f"TcpOptions.hooks must be a tcp Hooks, not {type(options.hooks).__name__}")
    return options.hooks
