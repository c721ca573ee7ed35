"""The verbs fault seam's logic, without a device: what it posts, when, and what it fails.

The device side (the same plans through real queue pairs and engines) runs in
the guest: tests/properties/test_real_faults.py with MORIIO_TEST_ENGINE_BACKENDS=verbs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from moriio_async import InvalidArgument, WcStatus
from moriio_async.backends.verbs import VerbsOptions
from moriio_async.backends.verbs.faults import PairFaults, VerbsFaultSeam
from moriio_async.core.faultplan import Action, FaultPlan, FaultRule
from moriio_async.status import Opcode
from moriio_async.work import Sge, WorkBatch, WorkRequest


class Device:
    """Stands in for the queue pair: records posts and failures; ``outstanding`` is set by the test."""

    def __init__(self, seam: VerbsFaultSeam, qp_num: int = 7) -> None:
        self.posted: list[tuple[list[int], list[bool]]] = []
        self.failed: list[tuple[list[list[int]], WcStatus]] = []
        self.outstanding = 0
        self.dead = False
        self.wakes = 0
        self.faults = PairFaults(
            seam, qp_num, post=self.post, fail=self.fail, outstanding=lambda: self.outstanding,
            dead=lambda: self.dead, wake=self.wake,
        )  # fmt: skip

    def post(self, batch: WorkBatch) -> None:
        self.posted.append(([batch.wr_id + i for i in range(len(batch))], batch.signaled.tolist()))
        self.outstanding += len(batch)

    def fail(self, parts: list[tuple[WorkBatch, int]], status: WcStatus) -> None:
        self.failed.append(([[b.wr_id + i for i in range(s, len(b))] for b, s in parts], status))

    def wake(self) -> None:
        self.wakes += 1


def eventually(check: Callable[[], bool], limit: float = 10.0) -> None:
    """Poll ``check`` (as the completion queue's polls would) until it holds; a loaded machine may be slow."""
    give_up = time.monotonic() + limit
    while not check():
        assert time.monotonic() < give_up, "the condition never held"
        time.sleep(0.005)


def batch(first: int, n: int) -> WorkBatch:
    return WorkBatch.from_requests(
        [WorkRequest(first + i, Opcode.RDMA_WRITE, (Sge(0, 8, 1),), 0, 2, i == n - 1) for i in range(n)]
    )


def seam(*rules: FaultRule, retry: float = 0.2) -> VerbsFaultSeam:
    return VerbsFaultSeam(FaultPlan(rules), retry)


def test_no_rule_posts_each_batch_whole_and_untouched() -> None:
    dev = Device(seam(FaultRule(Action.STATUS, qp=1, wr=0)))
    dev.faults.submit(batch(1, 4))
    dev.faults.submit(batch(5, 2))
    assert dev.posted == [([1, 2, 3, 4], [False, False, False, True]), ([5, 6], [False, True])]
    assert dev.faults.waiting == 0


def test_a_status_fails_its_request_once_the_earlier_ones_completed() -> None:
    s = seam(FaultRule(Action.STATUS, qp=0, wr=2, status=WcStatus.REM_OP_ERR))
    dev = Device(s)
    dev.faults.submit(batch(1, 5))
    assert dev.posted == [([1, 2], [False, True])]  # the last one before the fault is signaled
    assert dev.failed == [] and dev.faults.waiting == 3
    dev.faults.submit(batch(6, 2))  # waits behind
    dev.faults.due()
    assert dev.failed == []  # requests 1 and 2 still on the device
    dev.outstanding = 0
    dev.faults.due()
    assert dev.failed == [([[3, 4, 5], [6, 7]], WcStatus.REM_OP_ERR)]
    assert dev.faults.waiting == 0
    assert [(a.action, a.qp, a.wr, a.detail) for a in s.applied] == [(Action.STATUS, 0, 2, "REM_OP_ERR")]


def test_a_drop_at_the_first_request_fails_it_with_retry_exceeded_at_once() -> None:
    dev = Device(seam(FaultRule(Action.DROP, qp=0, wr=0)))
    dev.faults.submit(batch(1, 3))
    assert dev.posted == []
    assert dev.failed == [([[1, 2, 3]], WcStatus.RETRY_EXC_ERR)]


def test_a_delay_holds_its_request_and_the_later_ones_then_posts_them() -> None:
    dev = Device(seam(FaultRule(Action.DELAY, qp=0, wr=1, seconds=0.05)))
    dev.faults.submit(batch(1, 3))
    assert dev.posted == [([1], [True])]
    dev.faults.due()
    assert len(dev.posted) == 1
    eventually(lambda: dev.wakes == 1)  # the timer wakes the completion queue
    dev.faults.due()
    assert dev.posted[1] == ([2, 3], [False, True])


def test_delays_on_every_request_add_up() -> None:
    dev = Device(seam(FaultRule(Action.DELAY, qp=None, wr=None, seconds=0.02)))
    start = time.monotonic()
    dev.faults.submit(batch(1, 3))
    eventually(lambda: dev.faults.due() or len(dev.posted) == 3)
    assert [ids for ids, _ in dev.posted] == [[1], [2], [3]]
    assert time.monotonic() - start >= 0.06


def test_a_stall_past_the_retry_timeout_fails_with_retry_exceeded() -> None:
    dev = Device(seam(FaultRule(Action.STALL, qp=0, wr=1, seconds=0), retry=0.05))
    dev.faults.submit(batch(1, 3))
    eventually(lambda: dev.wakes == 1)
    dev.faults.due()
    assert dev.failed == []  # request 1 is still on the device
    dev.outstanding = 0
    dev.faults.due()
    assert dev.failed == [([[2, 3]], WcStatus.RETRY_EXC_ERR)]


def test_a_short_stall_is_a_delay() -> None:
    dev = Device(seam(FaultRule(Action.STALL, qp=0, wr=0, seconds=0.03), retry=1.0))
    dev.faults.submit(batch(1, 2))
    eventually(lambda: dev.wakes == 1)
    dev.faults.due()
    assert dev.posted == [([1, 2], [False, True])] and dev.failed == []


def test_a_dead_pair_flushes_what_waits() -> None:
    dev = Device(seam(FaultRule(Action.DELAY, qp=0, wr=0, seconds=60)))
    dev.faults.submit(batch(1, 2))
    dev.dead = True
    dev.faults.due()
    assert dev.failed == [([[1, 2]], WcStatus.WR_FLUSH_ERR)]
    dev.faults.close()


def test_pairs_are_numbered_by_first_post_and_requests_across_posts() -> None:
    s = seam(FaultRule(Action.STATUS, qp=1, wr=3))
    first, second = Device(s, qp_num=90), Device(s, qp_num=40)
    second.faults.submit(batch(1, 2))  # pair 0
    first.faults.submit(batch(1, 2))  # pair 1: requests 0, 1
    first.faults.submit(batch(3, 2))  # requests 2, 3
    assert second.failed == []
    assert first.posted == [([1, 2], [False, True]), ([3], [True])]
    assert first.failed == [] and first.faults.waiting == 1
    first.outstanding = 0
    first.faults.due()
    assert first.failed == [([[4]], WcStatus.REM_ACCESS_ERR)]


@pytest.mark.parametrize("value", [FaultPlan((FaultRule(Action.DROP, qp=0, wr=0),)), {"rules": [{"action": "drop"}]},
                                   '{"rules": [{"action": "drop", "wr": 0}]}'])  # fmt: skip
def test_the_plan_comes_from_the_verbs_options_as_a_plan_a_dict_or_json(value: Any) -> None:
    got = VerbsOptions(fault_plan=value).plan
    assert got is not None and got.rules[0].action is Action.DROP
    assert VerbsOptions().plan is None


def test_kill_and_malformed_plans_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="cannot kill"):
        seam(FaultRule(Action.KILL, qp=0, wr=0))
    with pytest.raises(InvalidArgument):
        VerbsOptions(fault_plan=42)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        VerbsOptions(fault_plan="{not json")


def test_after_the_pair_failed_later_requests_go_to_the_device_at_once_past_any_delay() -> None:
    """A pair in the error state flushes what is posted to it at once, as a real one does: a delay
    rule must not hold requests submitted after the failure (they would end as timeouts, not flushes,
    behind a wait of their own each). Found by the real-faults property on verbs under load."""
    dev = Device(
        seam(FaultRule(Action.DELAY, seconds=0.25), FaultRule(Action.STATUS, wr=0, status=WcStatus.REM_ACCESS_ERR))
    )
    dev.faults.submit(batch(1, 1))
    assert dev.failed == [([[1]], WcStatus.REM_ACCESS_ERR)]  # the status comes first, at once
    for wr_id in range(2, 7):
        dev.faults.submit(batch(wr_id, 1))
    assert [ids for ids, _ in dev.posted] == [[2], [3], [4], [5], [6]]  # to the device, which flushes them
    assert dev.faults.waiting == 0


def test_after_an_abort_later_requests_go_to_the_device_at_once() -> None:
    dev = Device(seam(FaultRule(Action.DELAY, seconds=5.0)))
    dev.faults.submit(batch(1, 1))
    assert dev.posted == [] and dev.faults.waiting == 1
    dev.faults.abort()
    dev.faults.due()
    assert dev.failed == [([[1]], WcStatus.WR_FLUSH_ERR)]
    dev.faults.submit(batch(2, 1))
    assert dev.posted == [([2], [True])] and dev.faults.waiting == 0
