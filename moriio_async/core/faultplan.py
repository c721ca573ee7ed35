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
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, final

from ..errors import InvalidArgument
from ..status import WcStatus

__all__ = ["Action", "Applied", "FaultPlan", "FaultRule"]


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


_RULE_KEYS = {"action", "qp", "wr", "seconds", "status"}


def _index(data: Mapping[str, Any], name: str) -> int | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgument(f"fault rule field {name!r} must be null or an integer >= 0, not {value!r}")
    return value


def _status(value: object) -> WcStatus:
    try:
        if isinstance(value, str):
            return WcStatus[value.upper()]
        if isinstance(value, int) and not isinstance(value, bool):
            return WcStatus(value)
    except (KeyError, ValueError):
        pass
    raise InvalidArgument(f"fault rule status {value!r} is not an ibv_wc_status name or number")


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

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"action": self.action.value, "qp": self.qp, "wr": self.wr}
        if self.action in (Action.DELAY, Action.STALL):
            data["seconds"] = self.seconds
        if self.action is Action.STATUS:
            data["status"] = self.status.name
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FaultRule:
        if not isinstance(data, Mapping):
            raise InvalidArgument(f"a fault rule is a JSON object, not {data!r}")
        unknown = set(data) - _RULE_KEYS
        if unknown:
            raise InvalidArgument(f"unknown fault rule field(s) {sorted(unknown)}; known: {sorted(_RULE_KEYS)}")
        try:
            action = Action(str(data.get("action")))
        except ValueError:
            raise InvalidArgument(
                f"fault action {data.get('action')!r} is not one of {[a.value for a in Action]}"
            ) from None
        seconds = data.get("seconds", 0.0)
        if isinstance(seconds, bool) or not isinstance(seconds, int | float):
            raise InvalidArgument(f"fault rule seconds must be a number, not {seconds!r}")
        status = _status(data["status"]) if "status" in data else WcStatus.REM_ACCESS_ERR
        return cls(action, _index(data, "qp"), _index(data, "wr"), float(seconds), status)


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

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"rules": [r.to_dict() for r in self.rules]}
        if self.about:
            data["about"] = self.about
        return data

    def dumps(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FaultPlan:
        if not isinstance(data, Mapping) or not isinstance(data.get("rules", []), list):
            raise InvalidArgument('a fault plan is a JSON object {"rules": [...], "about": "..."}')
        unknown = set(data) - {"rules", "about"}
        if unknown:
            raise InvalidArgument(f"unknown fault plan field(s) {sorted(unknown)}")
        about = data.get("about", "")
        if not isinstance(about, str):
            raise InvalidArgument("fault plan 'about' must be a string")
        return cls(tuple(FaultRule.from_dict(r) for r in data.get("rules", [])), about)

    @classmethod
    def loads(cls, text: str | bytes) -> FaultPlan:
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidArgument(f"a fault plan must be JSON: {exc}") from None
        return cls.from_dict(data)


@dataclass(frozen=True, slots=True)
class Applied:
    """A record that a rule fired: on which pair and request, and what it did."""

    action: Action
    qp: int
    wr: int
    detail: str = ""
