"""Fault plans as data: parsing, validation messages, the JSON form and what each rule says it does."""

from __future__ import annotations

import json

import pytest

from moriio_async.core.faultplan import Action, FaultPlan, FaultRule
from moriio_async.errors import InvalidArgument
from moriio_async.status import WcStatus


def test_each_rule_describes_itself_for_people() -> None:
    said = [
        FaultRule(Action.DELAY, qp=0, wr=3, seconds=0.25).describe(),
        FaultRule(Action.STATUS, status=WcStatus.RETRY_EXC_ERR).describe(),
        FaultRule(Action.DROP, wr=1).describe(),
        FaultRule(Action.STALL, qp=2, seconds=1.5).describe(),
        FaultRule(Action.STALL).describe(),
        FaultRule(Action.KILL, qp=1, wr=0).describe(),
    ]
    assert said == [
        "delay the completion 0.25s at request 3 of queue pair 0",
        "complete with RETRY_EXC_ERR at every request of every queue pair",
        "drop the connection at request 1 of every queue pair",
        "stall the target 1.5s at every request of queue pair 2",
        "stall the target until released at every request of every queue pair",
        "kill the target process at request 0 of queue pair 1",
    ]


def test_a_plan_round_trips_through_its_json_and_keeps_only_the_fields_each_action_uses() -> None:
    plan = FaultPlan(
        (
            FaultRule(Action.DELAY, qp=0, wr=3, seconds=0.5),
            FaultRule(Action.STATUS, wr=2, status=WcStatus.REM_OP_ERR),
            FaultRule(Action.STALL, qp=1),
            FaultRule(Action.KILL),
        ),
        about="four rules",
    )
    text = plan.dumps()
    assert text.endswith("}\n") and '\n  "rules": [' in text  # indented for people, one trailing newline
    assert json.loads(text) == {
        "rules": [
            {"action": "delay", "qp": 0, "wr": 3, "seconds": 0.5},
            {"action": "status", "qp": None, "wr": 2, "status": "REM_OP_ERR"},
            {"action": "stall", "qp": 1, "wr": None, "seconds": 0.0},
            {"action": "kill", "qp": None, "wr": None},
        ],
        "about": "four rules",
    }
    assert FaultPlan.loads(text) == plan
    assert FaultPlan.loads(text.encode()) == plan
    assert FaultPlan.loads('{"rules": []}') == FaultPlan()
    assert json.loads(FaultPlan().dumps()) == {"rules": []}  # no "about" when there is none
    assert FaultPlan.from_dict({}) == FaultPlan()


def test_statuses_are_read_by_name_in_any_case_or_by_number() -> None:
    def status(value: object) -> WcStatus:
        return FaultRule.from_dict({"action": "status", "status": value}).status

    assert status("rem_access_err") is WcStatus.REM_ACCESS_ERR
    assert status("WR_FLUSH_ERR") is WcStatus.WR_FLUSH_ERR
    assert status(int(WcStatus.RETRY_EXC_ERR)) is WcStatus.RETRY_EXC_ERR
    assert FaultRule.from_dict({"action": "status"}).status is WcStatus.REM_ACCESS_ERR  # the default
    for bad in ("NOT_A_STATUS", 999):
        with pytest.raises(InvalidArgument, match=r"fault rule status .* is not an ibv_wc_status name or number"):
            status(bad)
    for wrong in (True, 1.0, None):  # not a name or a number at all: refused where the JSON is read
        with pytest.raises(InvalidArgument, match=r"bad fault rule: Expected `int \| str`, got `\w+` - at `\$.status`"):
            status(wrong)


@pytest.mark.parametrize(
    ("rule", "needle"),
    [
        ([], "bad fault rule: Expected `object`, got `array`"),
        (
            {"action": "delay", "when": 1},
            "bad fault rule: Object contains unknown field `when`",
        ),
        ({"action": "explode"}, "fault action 'explode' is not one of ['delay', 'status', 'drop', 'stall', 'kill']"),
        ({}, "bad fault rule: Object missing required field `action`"),
        ({"action": "delay", "seconds": "1"}, "bad fault rule: Expected `float`, got `str` - at `$.seconds`"),
        ({"action": "delay", "seconds": True}, "bad fault rule: Expected `float`, got `bool` - at `$.seconds`"),
        ({"action": "delay", "seconds": -1}, "bad fault rule: Expected `float` >= 0.0 - at `$.seconds`"),
        ({"action": "delay", "seconds": float("nan")}, "bad fault rule: Expected `float` >= 0.0 - at `$.seconds`"),
        ({"action": "delay", "seconds": 86401}, "bad fault rule: Expected `float` <= 86400.0 - at `$.seconds`"),
        ({"action": "drop", "qp": -1}, "bad fault rule: Expected `int` >= 0 - at `$.qp`"),
        ({"action": "drop", "wr": True}, "bad fault rule: Expected `int | null`, got `bool` - at `$.wr`"),
        ({"action": "drop", "wr": 1.5}, "bad fault rule: Expected `int | null`, got `float` - at `$.wr`"),
        ({"action": "status", "status": "SUCCESS"}, "a status fault needs an error status, not SUCCESS"),
    ],
)
def test_a_bad_rule_is_refused_saying_what_is_wrong(rule: object, needle: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        FaultRule.from_dict(rule)  # type: ignore[arg-type]
    assert str(info.value) == needle


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("not json", "a fault plan must be JSON: JSON is malformed: invalid character (byte 4)"),
        (b"\xff\xfe", "a fault plan must be JSON: JSON is malformed: invalid character (byte 0)"),
        ("[]", "bad fault plan: Expected `object`, got `array`"),
        ('{"rules": {}}', "bad fault plan: Expected `array`, got `object` - at `$.rules`"),
        ('{"rules": [], "extra": 1}', "bad fault plan: Object contains unknown field `extra`"),
        ('{"rules": [], "about": 3}', "bad fault plan: Expected `str`, got `int` - at `$.about`"),
        ('{"rules": [{"action": "drop", "qp": -1}]}', "bad fault plan: Expected `int` >= 0 - at `$.rules[0].qp`"),
        (
            '{"rules": [' + ", ".join(['{"action": "drop"}'] * 1025) + "]}",
            "bad fault plan: Expected `array` of length <= 1024 - at `$.rules`",
        ),
        (
            '{"rules": [{"action": "nope"}]}',
            "fault action 'nope' is not one of ['delay', 'status', 'drop', 'stall', 'kill']",
        ),
    ],
)
def test_a_bad_plan_is_refused_saying_what_is_wrong(text: str | bytes, needle: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        FaultPlan.loads(text)
    assert str(info.value) == needle


def test_each_side_gets_its_own_rules_in_order_and_matching_picks_pair_and_request() -> None:
    rules = (
        FaultRule(Action.STALL, qp=0),
        FaultRule(Action.DELAY, seconds=1),
        FaultRule(Action.KILL, wr=4),
        FaultRule(Action.DROP, qp=1, wr=2),
    )
    plan = FaultPlan(list(rules), about="x")  # type: ignore[arg-type]
    assert plan.rules == rules  # a list is kept as a tuple
    assert plan.side(target=True) == FaultPlan((rules[0], rules[2]), "x")
    assert plan.side(target=False) == FaultPlan((rules[1], rules[3]), "x")
    assert plan.kills and not plan.side(target=False).kills
    assert [Action(a).at_target for a in Action] == [False, False, False, True, True]
    drop = rules[3]
    assert drop.matches(1, 2) and not drop.matches(1, 3) and not drop.matches(0, 2)
    assert rules[1].matches(5, 9) and rules[0].matches(0, 9) and not rules[0].matches(1, 0)


def test_a_rule_built_directly_checks_its_action_seconds_and_status() -> None:
    for args, message in (
        (("explode",), "unknown fault action 'explode'"),
        ((Action.DELAY, None, None, float("inf")), "fault rule seconds must be finite and >= 0, not inf"),
        ((Action.STATUS, 0, 0, 0.0, WcStatus.SUCCESS), "a status fault needs an error status, not SUCCESS"),
    ):
        with pytest.raises(InvalidArgument) as info:
            FaultRule(*args)  # type: ignore[arg-type]
        assert str(info.value) == message
    assert FaultRule(Action.DELAY, seconds=0.0).seconds == 0.0  # zero is allowed
    assert FaultRule(Action.DELAY, status=WcStatus.SUCCESS).status is WcStatus.SUCCESS  # only status rules care
