"""``moriio-async faults PLAN.json``: run a fault plan between two processes on loopback.

It starts a target process and an initiator process, both engines of the
same backend: TCP by default, with the plan's hooks (stall and kill act in
the target, the rest in the initiator); or ``--backend verbs``, where the
initiator's engine takes the whole plan in ``verbs=VerbsOptions(fault_plan=...)``
and applies it at its queue pairs (one-sided verbs run nothing in the target
to stall or kill; see ``backends/verbs/faults.py``). The initiator posts a batch of single-request
transfers on one session, waits for them with a deadline, and prints each
transfer's outcome as the wait left it, the faults that fired, and a
summary. ``--json`` prints the same as one JSON object per line. The exit
status is 0 when the batch ran (whatever its outcomes), 1 when a process
could not run it, 2 for a bad plan.

The two processes run this module with ``--role target`` and
``--role initiator``; ``run_batch`` is also what the tests call in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec

from ..aio.transfer import Transfer
from ..aio.wait import waiting_for_transfer_complete
from ..backends.described import VerbsFacts
from ..backends.options import TcpOptions, VerbsOptions
from ..backends.tcp.faults import PlanHooks
from ..core.faultplan import FaultPlan
from ..engine import IOEngine, IOEngineConfig
from ..errors import MoriioError, TransferError
from .fault_events import ChildEvent, Event, Faults, Ready, Summary, Target, TargetEnd, TransferLine, decode, encode

__all__ = ["BatchResult", "add_arguments", "outcome_of", "pattern", "run", "run_batch", "tcp_config"]

Out = Callable[[str], None]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", help="fault plan file (JSON; see examples/fault_plans/)")
    parser.add_argument("--transfers", type=int, default=8, help="transfers in the batch (default 8)")
    parser.add_argument("--size", type=int, default=4096, help="bytes per transfer (default 4096)")
    parser.add_argument("--op", choices=("write", "read"), default="write", help="RDMA WRITE or READ (default write)")
    parser.add_argument("--timeout", type=float, default=2.0, help="the wait's deadline in seconds (default 2)")
    parser.add_argument("--fail-fast", action="store_true", help="end the wait at the first failure")
    parser.add_argument(
        "--retry-timeout", type=float, default=1.0,
        help="silence after which a request fails with RETRY_EXC_ERR (default 1)",
    )  # fmt: skip
    parser.add_argument("--sq-depth", type=int, default=256, help="send-queue depth (default 256)")
    parser.add_argument(
        "--backend", choices=("tcp", "verbs"), default="tcp",
        help="tcp (default), or verbs: the plan applied at the initiator's queue pairs (no kill)",
    )  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help="loopback address both processes use")
    parser.add_argument("--json", action="store_true", help="one JSON object per line instead of text")
    parser.add_argument("--role", choices=("run", "target", "initiator"), default="run", help=argparse.SUPPRESS)
    parser.add_argument("--connect", default="", help=argparse.SUPPRESS)


def pattern(n: int) -> bytearray:
    """The target's buffer contents, so a READ can be checked byte for byte."""
    return bytearray((i * 7 + 3) % 251 for i in range(n))


def tcp_config(hooks: PlanHooks, **fields: Any) -> IOEngineConfig:
    """A TCP engine's config whose backend applies ``hooks`` (set before any queue pair exists)."""
    return IOEngineConfig(backend="tcp", tcp=TcpOptions(hooks=hooks), **fields)


def outcome_of(t: Transfer) -> str:
    """SUCCESS, the failure's ibv_wc_status name (or status code name), or TIMEOUT while pending."""
    if not t.done():
        return "TIMEOUT"
    if t.Succeeded():
        return "SUCCESS"
    err = t.error()
    assert err is not None
    return err.wc_status.name if err.wc_status is not None else err.code.name


@dataclass
class BatchResult:
    outcomes: list[str]
    listed: list[str | None]
    """Where the TransferError listed each transfer: "failed", "timed_out" or None."""
    data_ok: list[bool | None]
    elapsed: float
    deadline_reached: bool
    applied: list[str] = field(default_factory=list)

    def summary(self, timeout: float) -> Summary:
        """The batch's summary line, for a wait whose deadline was ``timeout`` seconds."""
        counts = dict(Counter(self.outcomes))
        return Summary(len(self.outcomes), counts, self.elapsed, timeout, self.deadline_reached)


async def run_batch(
    engine: IOEngine, address: str, *, transfers: int, size: int, op: str, timeout: float, fail_fast: bool
) -> BatchResult:
    """Connect to the target at ``address``, post the batch on one session, wait once with the deadline."""
    peer = await engine.connect(address)
    local = bytearray(transfers * size)
    desc = engine.register_memory(local, name="faults-local")
    session = await engine.create_session(desc, peer.memory["kv"])
    if op == "write":
        local[:] = pattern(len(local))
    post = session.write if op == "write" else session.read
    ts = [post(i * size, i * size, size) for i in range(transfers)]
    loop = asyncio.get_running_loop()
    start = loop.time()
    error: TransferError | None = None
    try:
        await waiting_for_transfer_complete(ts, timeout=timeout, fail_fast=fail_fast)
    except TransferError as exc:
        error = exc
    end = loop.time()
    outcomes = [outcome_of(t) for t in ts]
    failed = {e.transfer_id for e in error.failed} if error else set()
    timed_out = {e.transfer_id for e in error.timed_out} if error else set()
    listed = ["failed" if t.id in failed else "timed_out" if t.id in timed_out else None for t in ts]
    expect = pattern(len(local))
    data_ok: list[bool | None] = [
        (local[i * size : (i + 1) * size] == expect[i * size : (i + 1) * size])
        if op == "read" and o == "SUCCESS"
        else None
        for i, o in enumerate(outcomes)
    ]
    return BatchResult(outcomes, listed, data_ok, end - start, end >= start + timeout)


# -- the two processes -----------------------------------------------------------------------


def _config(args: argparse.Namespace, hooks: PlanHooks, plan: FaultPlan | None = None) -> IOEngineConfig:
    """TCP: the plan's hooks for this side; verbs: the whole plan (initiator) or nothing (target)."""
    common = IOEngineConfig(host=args.host, retry_timeout=args.retry_timeout, sq_depth=args.sq_depth)
    if args.backend == "tcp":
        return replace(common, backend="tcp", tcp=TcpOptions(hooks=hooks))
    return replace(common, backend=args.backend, verbs=VerbsOptions(fault_plan=plan))


def _emit(event: Event) -> None:
    print(encode(event), flush=True)


async def _target(args: argparse.Namespace, plan: FaultPlan) -> int:
    hooks = PlanHooks(plan.side(target=True), on_kill=lambda: os.kill(os.getpid(), signal.SIGKILL))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_term(signum: int, frame: object) -> None:
        # A plain handler, not loop.add_signal_handler: closing a stalled answering pair joins its
        # hook thread on the loop thread, so the loop may be blocked right now; this runs anyway
        # (the join's lock wait is interrupted) and the release lets that join finish.
        hooks.release()
        loop.call_soon_threadsafe(stop.set)

    signal.signal(signal.SIGTERM, on_term)
    async with IOEngine("faults-target", _config(args, hooks)) as engine:
        engine.register_memory(pattern(args.transfers * args.size), name="kv")
        _emit(Ready(engine.address, os.getpid()))
        await stop.wait()
    _emit(Faults("target", tuple(hooks.applied)))
    return 0


async def _initiator(args: argparse.Namespace, plan: FaultPlan) -> int:
    hooks = PlanHooks(plan.side(target=False))
    verbs = args.backend == "verbs"
    async with IOEngine("faults-initiator", _config(args, hooks, plan if verbs else None)) as engine:
        result = await run_batch(
            engine,
            args.connect,
            transfers=args.transfers,
            size=args.size,
            op=args.op,
            timeout=args.timeout,
            fail_fast=args.fail_fast,
        )
        hooks.release()  # a delayed completion holds a NIC thread that closing the engine joins
        for i, (outcome, listed, ok) in enumerate(zip(result.outcomes, result.listed, result.data_ok, strict=True)):
            _emit(TransferLine(i, args.op, args.size, outcome, listed, ok))
        # On verbs the backend applied the whole plan, and its description lists what fired.
        facts = engine.describe_backend()
        seam = facts.fault_plan if isinstance(facts, VerbsFacts) else None
        applied = seam.applied if seam is not None else hooks.applied
        _emit(Faults("initiator", tuple(applied)))
        _emit(result.summary(args.timeout))
    return 0


# -- the command ------------------------------------------------------------------------------


def _child(args: argparse.Namespace, role: str, extra: list[str]) -> list[str]:
    argv = [sys.executable, "-m", "moriio_async.cli.faults", args.plan, "--role", role]
    argv += ["--transfers", str(args.transfers), "--size", str(args.size), "--op", args.op]
    argv += ["--timeout", repr(args.timeout), "--retry-timeout", repr(args.retry_timeout)]
    argv += ["--sq-depth", str(args.sq_depth), "--host", args.host, "--backend", args.backend, *extra]
    return argv + (["--fail-fast"] if args.fail_fast else [])


def _text(event: ChildEvent, out: Out) -> None:
    if isinstance(event, TransferLine):
        outcome = event.outcome
        shown = (
            "SUCCESS"
            if outcome == "SUCCESS"
            else "TIMEOUT (still in flight)"
            if outcome == "TIMEOUT"
            else f"FAILED {outcome}"
        )
        data = "" if event.data_ok is None else ", data verified" if event.data_ok else ", DATA WRONG"
        out(f"transfer {event.index:3d}  {event.op} {event.bytes}B  {shown}{data}")
    elif isinstance(event, Faults):
        for a in event.applied:
            where = f"request {a.wr} of queue pair {a.qp}"
            out(f"fault fired ({event.side}): {a.action} at {where} {a.detail}".rstrip())
    elif isinstance(event, Summary):
        counts = ", ".join(f"{k} {v}" for k, v in sorted(event.outcomes.items()))
        reached = "deadline reached" if event.deadline_reached else "before the deadline"
        out(f"summary: {event.transfers} transfers: {counts}; the wait ended after {event.elapsed:.3f}s "
            f"({reached}; timeout {event.timeout:g}s)")  # fmt: skip


def _ready(line: str) -> Ready | None:
    """The target's first line, if it says it listens (nothing, or anything else: it did not start)."""
    try:
        event = decode(line)
    except msgspec.MsgspecError:
        return None
    return event if isinstance(event, Ready) else None


def run(args: argparse.Namespace, out: Out = print) -> int:
    try:
        plan = FaultPlan.loads(Path(args.plan).read_text())
    except (OSError, MoriioError) as exc:
        print(f"moriio-async faults: {exc}", file=sys.stderr)
        return 2
    if args.backend == "verbs" and plan.kills:
        print("moriio-async faults: kill rules need --backend tcp (one-sided verbs run nothing in the target "
              "process to kill it)", file=sys.stderr)  # fmt: skip
        return 2
    if args.role == "target":
        return asyncio.run(_target(args, plan))
    if args.role == "initiator":
        return asyncio.run(_initiator(args, plan))
    show: Out = (lambda line: out(line)) if args.json else (lambda line: _text(decode(line), out))
    if not args.json:
        out(f"fault plan {args.plan}" + (f": {plan.about}" if plan.about else ""))
        for rule in plan.rules:
            out(f"  rule: {rule.describe()}")
    started = time.monotonic()
    target = subprocess.Popen(_child(args, "target", []), stdout=subprocess.PIPE, text=True)
    try:
        assert target.stdout is not None
        ready = _ready(target.stdout.readline())
        if ready is None:
            print("moriio-async faults: the target process did not start", file=sys.stderr)
            return 1
        if args.json:
            out(encode(Target(ready.address, ready.pid)))
        else:
            out(f"target pid {ready.pid} at {ready.address}; initiator posts {args.transfers} {args.op}s "
                f"of {args.size} B, waits {args.timeout:g}s")  # fmt: skip
        initiator = subprocess.run(
            _child(args, "initiator", ["--connect", ready.address]),
            stdout=subprocess.PIPE,
            text=True,
            timeout=args.timeout + 4 * args.retry_timeout + 60,
            check=False,
        )
        for line in initiator.stdout.splitlines():
            show(line)
        if initiator.returncode != 0:
            print(f"moriio-async faults: the initiator failed (exit {initiator.returncode})", file=sys.stderr)
            return 1
    finally:
        if target.poll() is None:
            target.terminate()
        rest, _ = target.communicate(timeout=30)
    for line in rest.splitlines():
        show(line)
    status = "killed by SIGKILL (the plan)" if target.returncode == -signal.SIGKILL else f"exit {target.returncode}"
    if args.json:
        out(encode(TargetEnd(target.returncode)))
    else:
        out(f"target process: {status}; run took {time.monotonic() - started:.2f}s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moriio-async faults", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
