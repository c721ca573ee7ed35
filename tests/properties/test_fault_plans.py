"""Fault plans as data, and the hooks that apply them, without a backend."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moriio_async import InvalidArgument, WcStatus
from moriio_async.backends.tcp import Fault, PlanHooks
from moriio_async.core.faultplan import Action, FaultPlan, FaultRule
from moriio_async.status import Opcode
from moriio_async.work import Sge, WorkRequest

from .plans import plans


@given(plans(16, kill=True, max_seconds=30), st.text(max_size=20))
def test_a_plan_survives_json_unchanged(plan: FaultPlan, about: str) -> None:
    """A plan dumped to JSON and loaded back is the same plan (so hypothesis can shrink plans that
    the command line then runs)."""
    plan = FaultPlan(plan.rules, about)
    assert FaultPlan.loads(plan.dumps()) == plan
    assert FaultPlan.from_dict(json.loads(plan.dumps())) == plan


@pytest.mark.parametrize(
    "text",
    [
        "[]",
        '{"rules": {}}',
        '{"rules": [{"action": "explode"}]}',
        '{"rules": [{"action": "delay", "seconds": -1}]}',
        '{"rules": [{"action": "delay", "seconds": "soon"}]}',
        '{"rules": [{"action": "status", "status": "SUCCESS"}]}',
        '{"rules": [{"action": "status", "status": "NOT_A_STATUS"}]}',
        '{"rules": [{"action": "drop", "wr": -3}]}',
        '{"rules": [{"action": "drop", "qp": true}]}',
        '{"rules": [{"action": "drop", "when": 3}]}',
        '{"rules": [], "extra": 1}',
        "not json",
    ],
)
def test_a_bad_plan_is_refused_with_a_reason(text: str) -> None:
    with pytest.raises(InvalidArgument):
        FaultPlan.loads(text)


def wr(wr_id: int) -> WorkRequest:
    return WorkRequest(wr_id, Opcode.RDMA_WRITE, (Sge(0, 8, 1),), 0, 1)


def test_hooks_count_pairs_and_requests_and_apply_the_first_matching_rule() -> None:
    plan = FaultPlan(
        (
            FaultRule(Action.STATUS, qp=1, wr=2, status=WcStatus.REM_OP_ERR),
            FaultRule(Action.DROP, qp=0, wr=1),
            FaultRule(Action.DELAY, qp=None, wr=0, seconds=0.25),
            FaultRule(Action.DELAY, qp=None, wr=None, seconds=9),
        )
    )
    slept: list[float] = []
    hooks = PlanHooks(plan, sleep=slept.append)
    assert hooks.on_send(70, wr(1)) is None  # pair 0 (first seen), request 0
    assert hooks.on_send(90, wr(1)) is None  # pair 1, request 0
    assert hooks.on_send(70, wr(2)) is Fault.DROP  # pair 0, request 1
    assert hooks.on_send(90, wr(2)) is None
    assert hooks.on_send(90, wr(3)) is WcStatus.REM_OP_ERR  # pair 1, request 2
    assert hooks.on_response(90, wr(1), WcStatus.SUCCESS) is None
    assert hooks.on_response(90, wr(2), WcStatus.SUCCESS) is None
    assert slept == [0.25, 9]
    assert [(a.action, a.qp, a.wr) for a in hooks.applied] == [
        (Action.DROP, 0, 1),
        (Action.STATUS, 1, 2),
        (Action.DELAY, 1, 0),
        (Action.DELAY, 1, 1),
    ]


def test_a_plan_that_kills_needs_a_process_to_kill() -> None:
    plan = FaultPlan((FaultRule(Action.KILL, qp=0, wr=0),))
    with pytest.raises(InvalidArgument):
        PlanHooks(plan)
    killed: list[bool] = []
    hooks = PlanHooks(plan, on_kill=lambda: killed.append(True))
    assert hooks.on_request(5, int(Opcode.RDMA_WRITE), 1, 0, 8) is Fault.DROP
    assert killed == [True]
    assert plan.side(target=False).rules == ()
    PlanHooks(plan.side(target=False))  # the initiator's half kills nothing


def test_a_stall_lasts_its_seconds_or_until_released_and_release_ends_delays() -> None:
    import threading
    import time

    hooks = PlanHooks(FaultPlan((FaultRule(Action.STALL, qp=0, wr=0, seconds=0.05),
                                 FaultRule(Action.STALL, qp=1, wr=0, seconds=0),
                                 FaultRule(Action.DELAY, qp=None, wr=0, seconds=60))))  # fmt: skip
    start = time.monotonic()
    assert hooks.on_request(1, 0, 1, 0, 8) is None
    assert 0.04 <= time.monotonic() - start < 5
    threading.Timer(0.05, hooks.release).start()
    start = time.monotonic()
    assert hooks.on_request(2, 0, 1, 0, 8) is None  # pair 1: until released
    assert 0.04 <= time.monotonic() - start < 5
    start = time.monotonic()
    hooks.on_send(3, wr(1))
    assert hooks.on_response(3, wr(1), WcStatus.SUCCESS) is None  # released: a delay no longer holds
    assert time.monotonic() - start < 5
