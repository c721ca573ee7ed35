"""A bounded soak: many transfers between two real processes, with a fault plan and hostile
connections beside them; every transfer must end exactly once, none lost, memory and fds flat.

    python benchmarks/soak.py                          # 200k transfers, the built-in fault plan
    python benchmarks/soak.py --transfers 2000000      # millions
    python benchmarks/soak.py --seconds 300 --transfers 50000000 --hostile 8   # five minutes under attack
    python benchmarks/soak.py --plan examples/fault_plans/error_status.json --no-secret

The initiator (this process) keeps ``--depth`` single-block READs and WRITEs in
flight against a target process's exported region over the TCP backend, with
a shared secret unless ``--no-secret`` (so every data connection carries a
derived, single-use token). Both engines take the fault plan: the built-in one
cycles over queue pairs (REM_ACCESS_ERR, a dropped connection, late
completions, a target that stalls past ``retry_timeout``), so a session fails
every few thousand transfers and reconnects on a new queue pair. A third
process is hostile the whole time: rogue hellos, bad and deeply nested frames,
hellos on the data port with guessed tokens, and hellos trickled a byte at a
time. Each transfer counts its ends (a done-callback); at the end the soak
prints how many ended once, more than once, and never (lost), the outcomes,
RSS and open fds of both processes at start and end, and what the target
counted. Exit status 1 if a transfer did not end exactly once.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import gc
import json
import multiprocessing as mp
import os
import random
import secrets
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from moriio_async import IOEngine, IOEngineConfig, Session, TcpOptions, Transfer
from moriio_async.backends.described import TcpFacts
from moriio_async.core.faultplan import Action, FaultPlan, FaultRule
from moriio_async.status import WcStatus

BLOCK = 4096


def tcp_facts(engine: IOEngine) -> TcpFacts:
    facts = engine.describe_backend()
    assert isinstance(facts, TcpFacts), facts
    return facts


def default_plan(pairs: int = 32) -> FaultPlan:
    """Faults cycling over the first ``pairs`` queue pairs (each ended after a few thousand requests),
    then every later pair: a late completion, then REM_ACCESS_ERR. Few rules: each request is matched
    against them in order."""
    rules: list[FaultRule] = []
    for qp in range(pairs):
        kind = qp % 4
        if kind == 0:
            rules.append(FaultRule(Action.STATUS, qp, 3000, status=WcStatus.REM_ACCESS_ERR))
        elif kind == 1:
            rules.append(FaultRule(Action.DROP, qp, 2000))
        elif kind == 2:
            rules.append(FaultRule(Action.DELAY, qp, 500, seconds=0.02))
            rules.append(FaultRule(Action.STATUS, qp, 4000, status=WcStatus.REM_OP_ERR))
        else:  # the target stops answering past retry_timeout: RETRY_EXC_ERR
            rules.append(FaultRule(Action.STALL, qp, 1500, seconds=3.0))
    rules.append(FaultRule(Action.DELAY, None, 300, seconds=0.01))
    rules.append(FaultRule(Action.STATUS, None, 2500, status=WcStatus.REM_ACCESS_ERR))
    return FaultPlan(tuple(rules), "soak: a fault every few thousand requests, cycling over kinds")


def rss_and_fds(pid: int | str = "self") -> tuple[int, int]:
    """Resident set (bytes) and open fds of a process (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


# -- the target -------------------------------------------------------------------------------------


def _target(size: int, plan: str, secret: str, retry_timeout: float, pipe: Any) -> None:
    async def main() -> None:
        own = TcpOptions(fault_plan=FaultPlan.loads(plan) if plan else None)
        cfg = IOEngineConfig(backend="tcp", secret=secret, retry_timeout=retry_timeout, tcp=own)
        buf = np.full(size, 2, dtype=np.uint8)  # touched now: RSS at start already holds it
        async with IOEngine("soak-target", cfg) as engine:
            engine.register_memory(buf, name="kv")
            pipe.send({"address": engine.address, "data_port": tcp_facts(engine).data_port})
            done = asyncio.Event()
            loop = asyncio.get_running_loop()

            def on_command() -> None:
                if pipe.recv() == "stop":
                    done.set()

            loop.add_reader(pipe.fileno(), on_command)
            await done.wait()
            loop.remove_reader(pipe.fileno())
            stats = engine.statistics()
            pipe.send({"statistics": stats.figures(),
                       "data_plane": msgspec.structs.asdict(tcp_facts(engine).data_plane)})  # fmt: skip

    asyncio.run(main())


# -- the hostile process ---------------------------------------------------------------------------


def _hostile(address: str, data_port: int, threads: int, stop: Any, counts: Any) -> None:
    """Misbehave against the target until ``stop`` is set: ``threads`` attackers, one attack at a time each."""
    workers = [threading.Thread(target=_attacker, args=(address, data_port, seed, stop, counts))
               for seed in range(threads)]  # fmt: skip
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def _attacker(address: str, data_port: int, seed: int, stop: Any, counts: Any) -> None:
    host, port = address.rsplit(":", 1)
    rng = random.Random(seed)

    def frame(body: bytes) -> bytes:
        return struct.pack("!I", len(body)) + body

    def attack(kind: str) -> None:
        target = (host, int(port)) if kind in ("rogue-hello", "nested", "garbage") else (host, data_port)
        with socket.create_connection(target, timeout=5) as s:
            if kind == "rogue-hello":
                s.sendall(frame(json.dumps({"op": "hello", "id": 1, "engine": {
                    "kind": "EngineDesc", "key": "soak-target", "host": host, "port": 1, "incarnation": 1,
                    "backend": "tcp"}}).encode()))  # fmt: skip
            elif kind == "nested":
                s.sendall(frame(b'{"op":"hello","x":' + b"[" * 20000 + b"]" * 20000 + b"}"))
            elif kind == "garbage":
                s.sendall(os.urandom(rng.randint(1, 200)))
            elif kind == "token":
                s.sendall(struct.pack("<4sHH16sI", b"MRIO", 2, 0, os.urandom(16), 7))
            elif kind == "trickle":  # 28 bytes at 0.5 s each: past the hello's 10 s deadline
                hello = struct.pack("<4sHH16sI", b"MRIO", 2, 0, os.urandom(16), 7)
                for i in range(len(hello)):
                    if stop.is_set():
                        break
                    try:
                        s.sendall(hello[i : i + 1])
                    except OSError:
                        break  # cut at the deadline
                    time.sleep(0.5)
            s.settimeout(2)
            try:
                while s.recv(4096):
                    pass
            except OSError:
                pass

    kinds = ["rogue-hello", "nested", "garbage", "token", "trickle"]
    while not stop.is_set():
        kind = rng.choice(kinds)
        try:
            attack(kind)
            with counts.get_lock():
                counts[kinds.index(kind)] += 1
        except OSError:
            pass
        time.sleep(0.02)


# -- the initiator ---------------------------------------------------------------------------------


class Books:
    """Each transfer's ends, counted by a done-callback, and the outcomes by status."""

    def __init__(self, n: int) -> None:
        self.ends = np.zeros(n, dtype=np.uint8)
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.ended = 0
        self.expected = n  # lowered to what was issued when a --seconds run stops early
        self.all_ended = asyncio.Event()

    def issued(self, n: int) -> None:
        self.expected = n
        if self.ended >= n:
            self.all_ended.set()

    def on_end(self, release: Callable[[], None], i: int, t: Transfer) -> None:
        self.ends[i] = min(255, int(self.ends[i]) + 1)
        self.ended += 1
        self.outcomes["SUCCESS" if t.Succeeded() else t.Message().split(":")[0].split(" (")[0][:40]] += 1
        release()
        if self.ended >= self.expected:
            self.all_ended.set()


async def soak(args: argparse.Namespace, plan: FaultPlan | None) -> dict[str, Any]:
    secret = "" if args.no_secret else secrets.token_urlsafe(32)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    dumped = plan.dumps() if plan is not None else ""
    target = ctx.Process(target=_target, args=(args.region, dumped, secret, args.retry_timeout, child))
    target.start()
    info = parent.recv()
    stop, counts = ctx.Event(), ctx.Array("q", 5)
    hostile = ctx.Process(target=_hostile, args=(info["address"], info["data_port"], args.hostile, stop, counts))
    if args.hostile:
        hostile.start()
    cfg = IOEngineConfig(backend="tcp", secret=secret, retry_timeout=args.retry_timeout, transfer_timeout=30.0,
                         tcp=TcpOptions(fault_plan=plan))  # fmt: skip
    books = Books(args.transfers)
    local = np.ones(args.region, dtype=np.uint8)
    async with IOEngine("soak-initiator", cfg) as engine:
        peer = await engine.connect(info["address"])
        session: Session = await engine.create_session(engine.register_memory(local, name="l"), peer.memory["kv"])
        await session.read(0, 0, BLOCK).wait(10)
        window = asyncio.Semaphore(args.depth)
        slots = args.region // BLOCK
        rng = np.random.default_rng(7)
        offsets = (rng.integers(0, slots, size=min(args.transfers, 1 << 20)) * BLOCK).tolist()
        gc.collect()
        start = {"initiator": rss_and_fds(), "target": rss_and_fds(target.pid or 0)}
        samples: list[tuple[int, float, float]] = []  # (transfers issued, initiator RSS MB, target RSS MB)
        every = max(1, args.transfers // 10)
        began = time.perf_counter()
        until = began + args.seconds if args.seconds else float("inf")
        next_sample = began + args.seconds / 10 if args.seconds else float("inf")
        progress = _progress(args.transfers)
        issued = 0
        for i in range(args.transfers):
            if time.perf_counter() >= until:
                break
            await window.acquire()
            issued = i + 1
            off = offsets[i % len(offsets)]
            t = session.read(off, off, BLOCK) if i & 1 else session.write(off, off, BLOCK)
            t.add_done_callback(functools.partial(books.on_end, window.release, i))
            if i % 4096 == 0:
                progress(books.ended)
            if (not args.seconds and i % every == every - 1) or (i % 4096 == 0 and time.perf_counter() >= next_sample):
                next_sample += args.seconds / 10 if args.seconds else 0
                mine, theirs = rss_and_fds()[0], rss_and_fds(target.pid or 0)[0]
                samples.append((i + 1, round(mine / 2**20, 1), round(theirs / 2**20, 1)))
        books.issued(issued)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(books.all_ended.wait(), 60)  # what has not ended by then is lost
        progress(books.ended, final=True)
        elapsed = time.perf_counter() - began
        stop.set()  # the hostile connections end before the last count: fds at the end are what stays
        if args.hostile:
            await asyncio.to_thread(hostile.join, 30)
        await asyncio.sleep(0.5)
        gc.collect()
        end = {"initiator": rss_and_fds(), "target": rss_and_fds(target.pid or 0)}
        initiator_stats = engine.statistics()
        await session.close()
    parent.send("stop")
    target_report = parent.recv()
    target.join(10)

    ends = books.ends[:issued]
    once = int((ends == 1).sum())
    more = int((ends > 1).sum())
    lost = int((ends == 0).sum())
    report = {
        "transfers": issued, "depth": args.depth, "block": BLOCK, "secret": bool(secret),
        "plan": args.plan or "built in",
        "seconds": round(elapsed, 1), "transfers_per_s": round(issued / elapsed),
        "ended_exactly_once": once, "ended_more_than_once": more, "lost": lost,
        "outcomes": dict(books.outcomes.most_common()),
        "hostile_attempts": dict(zip(["rogue-hello", "nested", "garbage", "token", "trickle"], counts[:], strict=True)),
        "rss_mb": {who: [round(start[who][0] / 2**20, 1), round(end[who][0] / 2**20, 1)] for who in start},
        "fds": {who: [start[who][1], end[who][1]] for who in start},
        "rss_mb_every_tenth": samples,
        "initiator": {k: initiator_stats.figures()[k] for k in ("sessions", "links", "peers", "opened_qps")},
        "target": {k: target_report["statistics"][k] for k in ("links", "peers", "answering_qps", "rogue_hellos",
                                                                 "bad_frames", "auth_failures", "impersonations")},
        "target_data_plane": target_report["data_plane"],
    }  # fmt: skip
    return report


def _progress(total: int) -> Callable[..., None]:
    """A rich progress bar when rich is installed, else a line now and then."""
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
    except ImportError:
        last = [0.0]

        def plain(done: int, final: bool = False) -> None:
            if final or time.monotonic() - last[0] > 5:
                last[0] = time.monotonic()
                print(f"  {done:,} / {total:,} ended", flush=True)

        return plain
    bar = Progress("soak", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=True)
    task = bar.add_task("transfers", total=total)
    bar.start()

    def update(done: int, final: bool = False) -> None:
        bar.update(task, completed=done)
        if final:
            bar.stop()

    return update


def _print(report: dict[str, Any]) -> None:
    secret = "yes" if report["secret"] else "no"
    print(f"soak: {report['transfers']:,} transfers of {report['block']} B, {report['depth']} in flight, "
          f"secret {secret}, plan {report['plan']}: {report['seconds']} s "
          f"({report['transfers_per_s']:,}/s)")  # fmt: skip
    print(f"  ended exactly once {report['ended_exactly_once']:,}, more than once {report['ended_more_than_once']}, "
          f"lost {report['lost']}")  # fmt: skip
    print(f"  outcomes: {report['outcomes']}")
    print(f"  hostile attempts beside it: {report['hostile_attempts']}")
    for who in ("initiator", "target"):
        rss, fds = report["rss_mb"][who], report["fds"][who]
        print(f"  {who}: RSS {rss[0]} -> {rss[1]} MB, fds {fds[0]} -> {fds[1]}")
    tenths = report["rss_mb_every_tenth"]
    print(f"  RSS (MB) each tenth of the way, initiator: {[s[1] for s in tenths]}")
    print(f"  RSS (MB) each tenth of the way, target:    {[s[2] for s in tenths]}")
    print(f"  initiator: {report['initiator']}")
    print(f"  target: {report['target']}")
    print(f"  target data plane: {report['target_data_plane']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transfers", type=int, default=200_000, help="how many (with --seconds: at most)")
    p.add_argument("--seconds", type=float, default=0.0, help="run for this long instead (0: until --transfers)")
    p.add_argument("--depth", type=int, default=64, help="transfers in flight")
    p.add_argument("--region", type=int, default=8 << 20, help="bytes of the target's region")
    p.add_argument("--plan", help="a fault plan (JSON, e.g. examples/fault_plans/*.json), or none; default: built in")
    p.add_argument("--no-secret", action="store_true", help="engines without a shared secret")
    p.add_argument("--hostile", type=int, default=4, help="hostile threads beside the soak (0: none)")
    p.add_argument("--retry-timeout", type=float, default=1.0)
    p.add_argument("--json", help="also write the report here")
    args = p.parse_args()
    plan = None
    if args.plan != "none":
        plan = default_plan()
        if args.plan:
            with open(args.plan) as f:
                plan = FaultPlan.loads(f.read())
    if plan is not None and plan.kills:
        print("the soak's target must live: pick a plan without kill rules", file=sys.stderr)
        return 2
    report = asyncio.run(soak(args, plan))
    _print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    ok = report["lost"] == report["ended_more_than_once"] == 0 and report["ended_exactly_once"] == report["transfers"]
    return 0 if ok and (args.seconds or report["transfers"] == args.transfers) else 1


if __name__ == "__main__":
    sys.exit(main())
