"""The properties again with real time and a real data path under fault plans: TCP and verbs.

On the TCP backend (real sockets and threads) the plan's hooks act in both
engines; on verbs (the Soft-RoCE guest) the initiator's backend takes the
whole plan through ``VerbsOptions.fault_plan`` and applies it at its queue pairs
(``backends/verbs/faults.py``; no kill rules there). In this process (both
loops) and across two processes started by ``moriio-async faults`` (where a
TCP plan may also kill the target). Fewer examples than the deterministic
suites: each one waits on the clock.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moriio_async import IOEngine, IOEngineConfig, VerbsOptions
from moriio_async.backends.tcp import PlanHooks
from moriio_async.cli.faults import pattern, run_batch, tcp_config
from moriio_async.core.faultplan import Action, FaultPlan

from ..conftest import engine_backends
from .conftest import slow_examples
from .plans import expected, in_posting_order, listed_as, plans

EXAMPLES = sorted((Path(__file__).parents[2] / "examples" / "fault_plans").glob("*.json"))
PLANS = {path: FaultPlan.loads(path.read_text()) for path in EXAMPLES}
N = 8
TIMEOUT = 1.0
RETRY = 0.5
BOUND = 0.5

# Under emulation one `moriio-async faults` run (three Python processes) takes 45-65 s.
IN_GUEST = os.environ.get("MORIIO_GUEST") == "1"
slow_in_guest = pytest.mark.timeout(900 if IN_GUEST else 120)
FAULT_BACKENDS = [b for b in engine_backends() if b in ("tcp", "verbs")]
"""The backends with a fault-plan seam (FAULTS in tests/properties/conftest.py)."""
with_fault_seam = pytest.mark.parametrize("backend", FAULT_BACKENDS or [
    pytest.param("none", marks=pytest.mark.skip(reason="MORIIO_TEST_ENGINE_BACKENDS has no backend with fault plans"))
])  # fmt: skip


async def in_process(
    plan: FaultPlan, *, n: int, timeout: float, retry: float, op: str = "write", backend: str = "tcp"
) -> Any:
    """Run the command's batch here: two engines; TCP gets the plan's halves hooked into each, verbs
    gives the whole plan to the initiator's backend."""
    if backend == "verbs":
        target_cfg = IOEngineConfig(backend="verbs", retry_timeout=retry)
        initiator_cfg = IOEngineConfig(backend="verbs", retry_timeout=retry, verbs=VerbsOptions(fault_plan=plan))
        async with IOEngine("faults-target", target_cfg) as target, IOEngine("faults-initiator", initiator_cfg) as ini:
            target.register_memory(pattern(n * 4096), name="kv")
            return await run_batch(ini, target.address, transfers=n, size=4096, op=op, timeout=timeout, fail_fast=False)
    target_hooks = PlanHooks(plan.side(target=True))
    initiator_hooks = PlanHooks(plan.side(target=False))
    async with (
        IOEngine("faults-target", tcp_config(target_hooks, retry_timeout=retry)) as target,
        IOEngine("faults-initiator", tcp_config(initiator_hooks, retry_timeout=retry)) as initiator,
    ):
        target.register_memory(pattern(n * 4096), name="kv")
        try:
            return await run_batch(
                initiator, target.address, transfers=n, size=4096, op=op, timeout=timeout, fail_fast=False
            )
        finally:
            # Closing a queue pair joins its NIC threads, which a stall or a delay may be holding.
            target_hooks.release()
            initiator_hooks.release()


@functools.cache
def cli_example(path: Path, backend: str) -> tuple[dict[str, Any], ...]:
    """One command-line run per example plan and backend, shared by both loops' tests."""
    return tuple(cli(path, "--timeout", str(TIMEOUT), "--retry-timeout", str(RETRY), "--backend", backend))


def cli(plan: Path, *extra: str) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, "-m", "moriio_async.cli.faults", str(plan), "--json", *extra],
        capture_output=True,
        text=True,
        timeout=600 if IN_GUEST else 120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


def check_properties(outcomes: list[str], listed: list[str | None], elapsed: float, reached: bool, t: float) -> None:
    assert elapsed <= t + BOUND, f"the wait ended {elapsed - t:.3f}s after its deadline"
    if "TIMEOUT" in outcomes:
        assert reached, "a timeout was declared before the deadline"
    assert in_posting_order(outcomes), outcomes
    assert listed == [listed_as(o) for o in outcomes]


@slow_in_guest
@with_fault_seam
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
async def test_example_plans_show_the_same_outcomes_from_the_command_line_and_in_process(
    path: Path, backend: str
) -> None:
    """Each example plan gives, from `moriio-async faults` (two processes) and in this process, the
    outcomes its one rule implies."""
    plan = PLANS[path]
    if backend == "verbs" and plan.kills:
        pytest.skip("verbs: no seam runs in the target process to kill it (the two-guest tests kill a real peer)")
    want = expected(plan, N, timeout=TIMEOUT, retry_timeout=RETRY)
    events = cli_example(path, backend)
    got = [e["outcome"] for e in events if e["event"] == "transfer"]
    assert got == want
    if not plan.kills:  # a killed target reports nothing
        fired = [a for e in events if e["event"] == "faults" for a in e["applied"]]
        assert [a["action"] for a in fired][:1] == [plan.rules[0].action.value], fired
        here = await in_process(plan, n=N, timeout=TIMEOUT, retry=RETRY, backend=backend)
        assert here.outcomes == want
    else:
        assert next(e for e in events if e["event"] == "target_end")["returncode"] == -9


@with_fault_seam
@settings(max_examples=slow_examples(6))
@given(plans(6, kill=False, max_seconds=0.4), st.sampled_from(["write", "read"]))
async def test_fault_plans_keep_deadline_ordering_and_accounting(backend: str, plan: FaultPlan, op: str) -> None:
    """With real sockets and real time, under any plan of delays, error statuses, dropped connections
    and stalls: the wait ends by T plus a small bound and declares no timeout before T; on the one
    queue pair the outcomes are successes, then a failure and flushes or what was still pending; the
    TransferError lists exactly the transfers that did not succeed; READ data that succeeded is right."""
    timeout = 0.3
    r = await in_process(plan, n=6, timeout=timeout, retry=0.2, op=op, backend=backend)
    check_properties(r.outcomes, r.listed, r.elapsed, r.deadline_reached, timeout)
    assert all(ok is not False for ok in r.data_ok)


@slow_in_guest
@with_fault_seam
@settings(max_examples=slow_examples(3))
@given(plans(6, kill=True, max_seconds=1.5))
def test_fault_plans_across_two_processes_keep_deadline_ordering_and_accounting(
    tmp_path_factory: pytest.TempPathFactory, backend: str, plan: FaultPlan
) -> None:
    """The same across two processes and real sockets, where a plan may also kill the target
    process: the deadline, posting order and exact accounting hold from the command line's view."""
    if backend == "verbs":  # no kill rules on verbs: the same plan without them
        plan = FaultPlan(tuple(r for r in plan.rules if r.action is not Action.KILL), plan.about)
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text(plan.dumps())
    events = cli(path, "--transfers", "6", "--timeout", "1.0", "--retry-timeout", "0.5", "--backend", backend)
    transfers = [e for e in events if e["event"] == "transfer"]
    summary = next(e for e in events if e["event"] == "summary")
    check_properties(
        [e["outcome"] for e in transfers],
        [e["listed"] for e in transfers],
        summary["elapsed"],
        summary["deadline_reached"],
        1.0,
    )
    if any(r.action is Action.KILL for r in plan.rules) and "RETRY_EXC_ERR" in summary["outcomes"]:
        assert next(e for e in events if e["event"] == "target_end")["returncode"] in (-9, 0)
