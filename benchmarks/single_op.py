"""What one small operation costs on the mock, beside a bare copy of its bytes and the batch path, in one run.

    python benchmarks/single_op.py                               # 4 KiB, every row, 7 rounds
    python benchmarks/single_op.py --profile                     # also the cost split by layer (cProfile)
    python benchmarks/single_op.py --trees /tmp/base .           # the same rows in child processes, per tree

Two engines of this process on the mock backend, one session between them.
Each round runs, one after the other, the rows below with ``--ops`` operations
each, and takes the CPU time per operation (``time.process_time``: the mock
copies on the posting thread, so this is all the Python an operation costs):

* ``numpy copy``: ``dst[a:a+n] = src[b:b+n]`` over the same offsets, the floor;
* ``write``/``read`` sequential: ``await session.write(...)``, one at a time;
* ``write``/``read``, 16 in flight: a window of 16 ``Transfer``s;
* ``batch_write`` of 4 blocks, 16 in flight (per block);
* ``batch_write`` of 1024 scattered blocks, two in flight (per block: the batch path's per-request cost).

Printed: the median over the rounds of us per operation, and its ratio to the
numpy copy and to the batch path per request. ``--trees A B`` runs one round
per tree in turn (ABBA), each in a child with ``PYTHONPATH`` set to that tree
(this file measures every tree), and prints each row's median per tree and the
per-round ratio of each tree to the first. Figures compare only within a run.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from wr_cost import by_layer, layout

from moriio_async import IOEngine, IOEngineConfig, Session, Transfer

SIZE = 4096
SPAN = 64  # distinct block slots the single ops cycle through


async def pair(size: int, blocks: int) -> tuple[list[IOEngine], Session, Any, Any]:
    init = await IOEngine("initiator", IOEngineConfig(backend="mock")).start()
    target = await IOEngine("target", IOEngineConfig(backend="mock")).start()
    nbytes = 2 * size * max(blocks, SPAN)
    there = np.zeros(nbytes, dtype=np.uint8)
    here = np.ones(nbytes, dtype=np.uint8)
    target.register_memory(there, name="buf")
    local = init.register_memory(here, name="")
    peer = await init.connect(target.address)
    session = await init.create_session(local, peer.memory["buf"])
    return [init, target], session, here, there


def rows(session: Session, here: Any, there: Any, size: int, n: int) -> dict[str, Callable[[], Awaitable[int]]]:
    """Row name -> a coroutine factory that runs the row once and returns how many operations it did."""
    step = 2 * size
    offs = [(i % SPAN) * step for i in range(n)]
    lo4, ro4, sz4, _ = layout(4, size)
    lo_b, ro_b, sz_b, _ = layout(1024, size)

    async def copy() -> int:
        for off in offs:
            there[off : off + size] = here[off : off + size]
        return n

    def sequential(call: Callable[[int, int, int], Transfer]) -> Callable[[], Awaitable[int]]:
        async def run() -> int:
            for off in offs:
                await call(off, off, size)
            return n

        return run

    def windowed(start: Callable[[int], Transfer], count: int, depth: int, per: int) -> Callable[[], Awaitable[int]]:
        async def run() -> int:
            window: collections.deque[Transfer] = collections.deque()
            for i in range(count):
                if len(window) >= depth:
                    await window.popleft()
                window.append(start(offs[i % n]))
            for t in window:
                await t
            return count * per

        return run

    batches = max(2, n // 1024)
    return {
        "numpy copy": copy,
        "write, sequential": sequential(session.write),
        "read, sequential": sequential(session.read),
        "write, 16 in flight": windowed(lambda off: session.write(off, off, size), n, 16, 1),
        "read, 16 in flight": windowed(lambda off: session.read(off, off, size), n, 16, 1),
        "batch_write of 4, 16 in flight (per block)": windowed(
            lambda _: session.batch_write(lo4, ro4, sz4), max(1, n // 4), 16, 4
        ),
        "batch_write of 1024, 2 in flight (per block)": windowed(
            lambda _: session.batch_write(lo_b, ro_b, sz_b), batches, 2, 1024
        ),
    }


async def measure(size: int, n: int, rounds: int, profile: bool) -> dict[str, Any]:
    engines, session, here, there = await pair(size, 1024)
    cpu: dict[str, list[float]] = collections.defaultdict(list)
    layers: dict[str, dict[str, float]] = {}
    try:
        table = rows(session, here, there, size, n)
        for run in table.values():
            await run()  # warm up
        for _ in range(rounds):
            for name, run in table.items():
                t0 = time.process_time()
                ops = await run()
                cpu[name].append(1e6 * (time.process_time() - t0) / ops)
        if profile:
            for name, run in table.items():
                prof = cProfile.Profile()
                prof.enable()
                await run()
                prof.disable()
                layers[name] = by_layer(prof)
    finally:
        for engine in reversed(engines):
            await engine.close()
    return {"cpu_us": dict(cpu), "layers": layers}


def summary(cpu: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in cpu.items()}


def print_table(med: dict[str, float]) -> None:
    floor = med["numpy copy"]
    batch = med["batch_write of 1024, 2 in flight (per block)"]
    print(f"{'row':46} {'us/op':>7} {'x copy':>7} {'x batch/req':>11}")
    for name, us in med.items():
        print(f"{name:46} {us:7.2f} {us / floor:7.1f} {us / batch:11.2f}")


def compare_trees(trees: list[str], argv: list[str], rounds: int) -> None:
    per_tree: dict[str, dict[str, list[float]]] = {t: collections.defaultdict(list) for t in trees}
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for i, tree in enumerate(trees if r % 2 == 0 else trees[::-1]):  # ABBA: neither always runs first
                out = os.path.join(tmp, f"{r}-{i}.json")
                loads.append(os.getloadavg()[0])
                env = {**os.environ, "PYTHONPATH": tree}
                subprocess.run([sys.executable, __file__, *argv, "--rounds", "1", "--json", out], env=env, check=True,
                               stdout=subprocess.DEVNULL)  # fmt: skip
                with open(out) as f:
                    for name, values in json.load(f)["cpu_us"].items():
                        per_tree[tree][name] += values
    first = trees[0]
    print(f"{rounds} rounds per tree, load average {min(loads):.1f}-{max(loads):.1f}")
    print(f"{'row':46} " + " ".join(f"{os.path.basename(t.rstrip('/')) or t:>14}" for t in trees) + "  ratio to first")
    for name in per_tree[first]:
        meds = [statistics.median(per_tree[t][name]) for t in trees]
        ratios = [
            statistics.median(a / b for a, b in zip(per_tree[t][name], per_tree[first][name], strict=True))
            for t in trees[1:]
        ]
        print(f"{name:46} " + " ".join(f"{m:14.2f}" for m in meds) + "  " + " ".join(f"{x:.3f}" for x in ratios))
    for tree in trees:
        print(f"\n{tree}:")
        print_table({name: statistics.median(v) for name, v in per_tree[tree].items()})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=8192, help="operations per row per round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--profile", action="store_true", help="then one more pass per row under cProfile, by layer")
    ap.add_argument("--trees", nargs="+", help="checkouts to import moriio_async from, one child per round")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    if args.trees:
        compare_trees([os.path.abspath(t) for t in args.trees], ["--ops", str(args.ops)], args.rounds)
        return 0
    got = asyncio.run(measure(SIZE, args.ops, args.rounds, args.profile))
    print(f"4 KiB on the mock, {args.ops} operations per row, median of {args.rounds} rounds (CPU per operation)")
    print_table(summary(got["cpu_us"]))
    for name, split in got["layers"].items():
        print(f"  {name}: " + ", ".join(f"{k} {v:.0%}" for k, v in split.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(got, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
