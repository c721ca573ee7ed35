"""Fault plans: which requests to hurt and how, as data (no I/O, no threads).

A plan is a tuple of rules. A rule picks requests by queue pair and by
position, and says what happens to them:

``delay``
    The request's completion comes ``seconds`` late (initiator side). A pair
    completes in posting order, so the completions after it wait too.
``status``
    The request completes with ``status`` without being sent (initiator). A
    failure puts the pair in the error state: every later request flushes.
``drop``
    The data connection is cut just before the request is sent (initiator),
    as a crashed peer or a cut cable would: the oldest outstanding request
    fails with RETRY_EXC_ERR, the rest flush.
``stall``
    When the request arrives, the target stops answering with the socket
    open, for ``seconds`` (0: until ``PlanHooks.release``). Past the
    initiator's ``retry_timeout`` the request fails with RETRY_EXC_ERR.
``kill``
    The target process dies (SIGKILL) when the request arrives. Only a
    process that owns nothing else may do that: see ``PlanHooks(on_kill=)``.

``qp`` counts queue pairs in the order this side first sees a request on
them (0 is the first; a pair that replaces a failed one gets the next
number); ``wr`` counts requests on that pair in posting order, from 0.
``None`` in either means every one. For one session the target counts the
same pairs and requests as the initiator. A plan is JSON::

    {"rules": [{"action": "status", "qp": 0, "wr": 3, "status": "REM_ACCESS_ERR"}]}

A backend applies a plan at its own seams: the TCP backend takes one as
``IOEngineConfig(tcp=TcpOptions(fault_plan=plan))`` (or ``verbs=VerbsOptions(...)``), or as hooks made from
it (``moriio_async.backends.tcp.PlanHooks``) when the caller wants to see
what fired or to release stalls.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Annotated, TypeVar, final

import msgspec

from ..errors import InvalidArgument
from ..status import WcStatus

__all__ = [
    "MAX_ABOUT",
    "MAX_RULES",
    "MAX_SECONDS",
    "Action",
    "Applied",
    "FaultPlan",
    "FaultRule",
    "PlanJson",
    "RuleJson",
]


class Action(enum.StrEnum):
    DELAY = "delay"
    STATUS = "status"
    DROP = "drop"
    STALL = "stall"
    KILL = "kill"

    @property
    def at_target(self) -> bool:
        """Applied by the target (the passive side) rather than by the initiator."""
        return self in (Action.STALL, Action.KILL)


MAX_RULES = 1024
"""Rules a plan may hold (a plan read from JSON is bounded: a file cannot make one without end)."""
MAX_ABOUT = 4096
"""Characters of ``about`` a plan read from JSON may carry."""
MAX_SECONDS = 86400.0
"""The longest delay or stall a rule read from JSON may ask for (a day)."""
_Index = Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFFFF)] | None


_J = TypeVar("_J", bound=msgspec.Struct)


class RuleJson(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A rule as JSON: ``seconds`` only for delay and stall, ``status`` (a name in any case, or its
    number) only for status; ``qp`` and ``wr`` are null for every one."""

    action: str
    qp: _Index = None
    wr: _Index = None
    seconds: Annotated[float, msgspec.Meta(ge=0, le=MAX_SECONDS)] | msgspec.UnsetType = msgspec.UNSET
    status: str | int | msgspec.UnsetType = msgspec.UNSET


class PlanJson(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A plan as JSON: ``{"rules": [...], "about": "..."}`` (``about`` left out when empty)."""

    rules: Annotated[list[RuleJson], msgspec.Meta(max_length=MAX_RULES)] = []
    about: Annotated[str, msgspec.Meta(max_length=MAX_ABOUT)] | msgspec.UnsetType = msgspec.UNSET


def _read(data: object, into: type[_J]) -> _J:
    """``data`` (JSON's Python objects) checked as ``into``: a wrong shape or type, an unknown field or a
    value out of bounds is an InvalidArgument saying where."""
    try:
        return msgspec.convert(data, into)
    except msgspec.ValidationError as exc:
        raise InvalidArgument(f"bad fault {'plan' if into is PlanJson else 'rule'}: {exc}") from None


def _status(value: str | int) -> WcStatus:
    try:
        return WcStatus[value.upper()] if isinstance(value, str) else WcStatus(value)
    except (KeyError, ValueError):
        raise InvalidArgument(f"fault rule status {value!r} is not an ibv_wc_status name or number") from None


@final
@dataclass(frozen=True, slots=True)
class FaultRule:
    """One fault: ``action`` on request ``wr`` of queue pair ``qp`` (None: every one)."""

    action: Action
    qp: int | None = None
    wr: int | None = None
    seconds: float = 0.0
    """``delay``: how late; ``stall``: how long (0: until released)."""
    status: WcStatus = WcStatus.REM_ACCESS_ERR
    """``status``: the status the request completes with."""

    def __post_init__(self) -> None:
        if not isinstance(self.action, Action):
            raise InvalidArgument(f"unknown fault action {self.action!r}")
        if not (math.isfinite(self.seconds) and self.seconds >= 0):
            raise InvalidArgument(f"fault rule seconds must be finite and >= 0, not {self.seconds!r}")
        if self.action is Action.STATUS and self.status is WcStatus.SUCCESS:
            raise InvalidArgument("a status fault needs an error status, not SUCCESS")

    def describe(self) -> str:
        what = {
            Action.DELAY: f"delay the completion {self.seconds:g}s",
            Action.STATUS: f"complete with {self.status.name}",
            Action.DROP: "drop the connection",
            Action.STALL: f"stall the target {f'{self.seconds:g}s' if self.seconds else 'until released'}",
            Action.KILL: "kill the target process",
        }[self.action]
        req = "every request" if self.wr is None else f"request {self.wr}"
        pair = "every queue pair" if self.qp is None else f"queue pair {self.qp}"
        return f"{what} at {req} of {pair}"

    def matches(self, qp: int, wr: int) -> bool:
        return (self.qp is None or self.qp == qp) and (self.wr is None or self.wr == wr)

    def to_json(self) -> RuleJson:
        timed = self.action in (Action.DELAY, Action.STALL)
        status = self.status.name if self.action is Action.STATUS else msgspec.UNSET
        return RuleJson(self.action.value, self.qp, self.wr, self.seconds if timed else msgspec.UNSET, status)

    @classmethod
    def from_json(cls, rule: RuleJson) -> FaultRule:
        try:
            action = Action(rule.action)
        except ValueError:
            raise InvalidArgument(f"fault action {rule.action!r} is not one of {[a.value for a in Action]}") from None
        seconds = 0.0 if rule.seconds is msgspec.UNSET else float(rule.seconds)
        status = WcStatus.REM_ACCESS_ERR if rule.status is msgspec.UNSET else _status(rule.status)
        return cls(action, rule.qp, rule.wr, seconds, status)

    @classmethod
    def from_dict(cls, data: object) -> FaultRule:
        """A rule from JSON's Python objects (a dict), checked (``RuleJson``)."""
        return cls.from_json(_read(data, RuleJson))


@final
@dataclass(frozen=True, slots=True)
class FaultPlan:
    """An ordered set of rules; at each seam the first rule that matches a request applies."""

    rules: tuple[FaultRule, ...] = ()
    about: str = ""
    """What the plan shows, for people (printed by ``moriio-async faults``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", tuple(self.rules))

    @property
    def kills(self) -> bool:
        return any(r.action is Action.KILL for r in self.rules)

    def side(self, *, target: bool) -> FaultPlan:
        """The rules one side applies (stall and kill at the target, the rest at the initiator)."""
        return FaultPlan(tuple(r for r in self.rules if r.action.at_target == target), self.about)

    def to_json(self) -> PlanJson:
        return PlanJson([r.to_json() for r in self.rules], self.about or msgspec.UNSET)

    def dumps(self) -> str:
        """The plan as JSON, indented for people, with one trailing newline."""
        return msgspec.json.format(msgspec.json.encode(self.to_json()), indent=2).decode() + "\n"

    @classmethod
    def from_json(cls, plan: PlanJson) -> FaultPlan:
        about = "" if plan.about is msgspec.UNSET else plan.about
        return cls(tuple(FaultRule.from_json(r) for r in plan.rules), about)

    @classmethod
    def from_dict(cls, data: object) -> FaultPlan:
        """A plan from JSON's Python objects (a dict), checked (``PlanJson``)."""
        return cls.from_json(_read(data, PlanJson))

    @classmethod
    def loads(cls, text: str | bytes) -> FaultPlan:
        """A plan from its JSON text, checked (``PlanJson``)."""
        try:
            plan = _PLAN_DECODER.decode(text)
        except msgspec.ValidationError as exc:
            raise InvalidArgument(f"bad fault plan: {exc}") from None
        except msgspec.DecodeError as exc:
            raise InvalidArgument(f"a fault plan must be JSON: {exc}") from None
        return cls.from_json(plan)


@dataclass(frozen=True, slots=True)
class Applied:
    """A record that a rule fired: on which pair and request, and what it did."""

    action: Action
    qp: int
    wr: int
    detail: str = ""


_PLAN_DECODER = msgspec.json.Decoder(PlanJson)
