"""integrations.orphans: a WRITE-mode decode request that ends before its KV arrived gives its blocks back once."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from moriio_async.integrations.orphans import WriteWaits


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeScheduler:
    """The three methods of vLLM's MoRIIOConnectorScheduler that WriteWaits wraps, as a consumer has them."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int, worker: Any) -> None:
        self.calls.append("alloc")
        request.kv_transfer_params["do_remote_prefill"] = False  # as vLLM does once it has notified the producer

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, None]:
        self.calls.append("finished")
        return False, None

    def update_connector_output(self, output: Any) -> None:
        self.calls.append("update")


def request(rid: str, remote: bool = True) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, kv_transfer_params={"do_remote_prefill": remote})


def output(*recving: str) -> SimpleNamespace:
    return SimpleNamespace(finished_recving=set(recving) or None)


def installed() -> tuple[FakeScheduler, WriteWaits, Clock]:
    clock, sched = Clock(), FakeScheduler()
    waits = WriteWaits(20.0, clock)
    assert waits.install(sched)
    return sched, waits, clock


def test_a_request_that_ended_waiting_is_reported_received_after_the_grace_and_only_once() -> None:
    sched, _, clock = installed()
    sched.update_state_after_alloc(request("a"), None, 64, None)
    assert sched.request_finished(request("a"), [[1, 2]]) == (False, None)  # vLLM's answer passes through
    clock.now += 19.9
    out = output()
    sched.update_connector_output(out)
    assert not out.finished_recving
    clock.now += 0.2
    out = output("x")
    sched.update_connector_output(out)
    assert out.finished_recving == {"x", "a"}
    out = output()
    sched.update_connector_output(out)
    assert not out.finished_recving
    assert sched.calls == ["alloc", "finished", "update", "update", "update"]


def test_a_request_whose_kv_arrived_is_never_reported_again() -> None:
    sched, waits, clock = installed()
    sched.update_state_after_alloc(request("a"), None, 64, None)
    sched.update_connector_output(output("a"))
    sched.request_finished(request("a"), [[1]])
    clock.now += 100
    out = output()
    sched.update_connector_output(out)
    assert not out.finished_recving and not waits.orphans and not waits.waiting


def test_a_notice_arriving_during_the_grace_cancels_the_orphan() -> None:
    sched, waits, clock = installed()
    sched.update_state_after_alloc(request("a"), None, 64, None)
    sched.request_finished(request("a"), [[1]])
    clock.now += 5
    sched.update_connector_output(output("a"))
    clock.now += 100
    out = output()
    sched.update_connector_output(out)
    assert not out.finished_recving and not waits.orphans


def test_requests_with_nothing_to_receive_are_not_tracked() -> None:
    sched, waits, clock = installed()
    sched.update_state_after_alloc(request("local", remote=False), None, 64, None)
    sched.update_state_after_alloc(request("hit"), None, 0, None)  # a full local hit: nothing is written
    sched.request_finished(request("local"), [[1]])
    sched.request_finished(request("hit"), [[2]])
    clock.now += 100
    out = output()
    sched.update_connector_output(out)
    assert not out.finished_recving and not waits.waiting and not waits.orphans


def test_a_scheduler_without_the_known_names_is_left_alone() -> None:
    sched = SimpleNamespace(request_finished=lambda *a: None)
    assert not WriteWaits(1.0).install(sched)
    assert not hasattr(sched, "update_connector_output")
