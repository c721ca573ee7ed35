"""Fault plans for the TCP backend: strategies, an oracle for one-rule plans, and the outcome shape.

Outcome codes are those of ``moriio-async faults``: SUCCESS, TIMEOUT, or the
failure's ibv_wc_status name.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from hypothesis import strategies as st

from moriio_async.core.faultplan import Action, FaultPlan, FaultRule

from .model import ERRORS

FLUSH = "WR_FLUSH_ERR"
RETRY = "RETRY_EXC_ERR"


def rules(n: int, *, kill: bool, max_seconds: float) -> st.SearchStrategy[FaultRule]:
    wr = st.one_of(st.none(), st.integers(0, n - 1))
    qp = st.one_of(st.none(), st.just(0))
    out = [
        st.builds(FaultRule, st.just(Action.DELAY), qp, wr, st.floats(0, max_seconds)),
        st.builds(FaultRule, st.just(Action.STATUS), qp, st.integers(0, n - 1), st.just(0.0), st.sampled_from(ERRORS)),
        st.builds(FaultRule, st.just(Action.DROP), qp, st.integers(0, n - 1)),
        st.builds(FaultRule, st.just(Action.STALL), qp, st.integers(0, n - 1), st.floats(0.01, max_seconds)),
    ]
    if kill:
        out.append(st.builds(FaultRule, st.just(Action.KILL), qp, st.integers(0, n - 1)))
    return st.one_of(out)


def plans(n: int, *, kill: bool, max_seconds: float) -> st.SearchStrategy[FaultPlan]:
    return st.lists(rules(n, kill=kill, max_seconds=max_seconds), min_size=1, max_size=2).map(
        lambda rs: FaultPlan(tuple(rs))
    )


_SHAPE = re.compile(r"S*(?:[XF]F*|T*)")


def shape(outcomes: Sequence[str]) -> str:
    return "".join("S" if o == "SUCCESS" else "T" if o == "TIMEOUT" else "F" if o == FLUSH else "X" for o in outcomes)


def in_posting_order(outcomes: Sequence[str]) -> bool:
    """One queue pair: successes, then either a failure and flushes, or what was still pending."""
    return _SHAPE.fullmatch(shape(outcomes)) is not None


def listed_as(outcome: str) -> str | None:
    return None if outcome == "SUCCESS" else "timed_out" if outcome == "TIMEOUT" else "failed"


def expected(plan: FaultPlan, n: int, *, timeout: float, retry_timeout: float) -> list[str]:
    """The outcomes of n single-request transfers posted at once under a one-rule plan on pair 0.

    Only plans whose outcome does not depend on thread timing are given here: a drop before the
    first request, a delay either far below or far beyond the deadline, a stall or a kill.
    """
    (rule,) = plan.rules
    assert rule.qp in (0, None)
    k = 0 if rule.wr is None else rule.wr
    if rule.action is Action.STATUS:
        return ["SUCCESS"] * k + [rule.status.name] + [FLUSH] * (n - k - 1)
    if rule.action is Action.DROP:
        assert k == 0, "a drop after the first request races the responses already on their way"
        return [RETRY] + [FLUSH] * (n - 1)
    if rule.action is Action.DELAY:
        total = rule.seconds * (n - k if rule.wr is None else 1)
        if total < timeout / 4:
            return ["SUCCESS"] * n
        assert rule.seconds > 2 * timeout, "a delay near the deadline is a race"
        return ["SUCCESS"] * k + ["TIMEOUT"] * (n - k)
    if rule.action is Action.STALL and (rule.seconds == 0 or rule.seconds > retry_timeout) and retry_timeout < timeout:
        return ["SUCCESS"] * k + [RETRY] + [FLUSH] * (n - k - 1)
    if rule.action is Action.KILL:
        return ["SUCCESS"] * k + [RETRY] + [FLUSH] * (n - k - 1)
    raise AssertionError(f"no oracle for {rule}")
