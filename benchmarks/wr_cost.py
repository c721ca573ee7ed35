"""What one work request costs: CPU and wall time per request, for batches and for single ops.

    python benchmarks/wr_cost.py                                 # the grid below, mock and tcp
    python benchmarks/wr_cost.py --backends mock --sizes 4K --blocks 1024 --profile
    python benchmarks/wr_cost.py --json out.json
    python benchmarks/wr_cost.py --backends mock --procs 1 --sizes 4K --blocks 1 --uids   # uid vs none
    python benchmarks/wr_cost.py --against /tmp/base-tree --rounds 8      # single-op row: this tree vs another

Each row issues ``batch_write``s (then ``batch_read``s) of N non-contiguous
blocks (gaps on both sides, so nothing merges and every block is its own work
request) and reports, per work request: CPU time of the initiator's process
(both engines when they share it) and of the target process (two-process
rows), and wall time. Two batches stay in flight. The single-op row keeps 64
one-block ``write``s in flight, as a serving loop does, and reports ops/s;
with ``--uids`` it runs again with a fresh transfer uid per write (each one
then sends its target a ``done`` notice), alternating rounds with the plain
row, and prints the ratio of the two. ``--against TREE`` runs the single-op
row (mock, one process) in child processes alternating between that source
tree (e.g. a ``git archive`` of an earlier commit) and this one, and prints
the median ratio of CPU per write (this tree / that one).

``--profile`` runs the mock row under cProfile and splits its CPU time by
layer (core, aio, engine, each backend, numpy, the event loop). Figures are
for comparison inside one run: this machine's load moves them.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import json
import multiprocessing as mp
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from moriio_async import IOEngine, IOEngineConfig, Session, Transfer

UNITS = {"K": 1 << 10, "M": 1 << 20}
TICK = os.sysconf("SC_CLK_TCK")


def parse_size(text: str) -> int:
    return int(text[:-1]) * UNITS[text[-1].upper()] if text[-1].upper() in UNITS else int(text)


def layout(blocks: int, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Offsets with a gap after every block on both sides, remote in reverse order: nothing merges."""
    idx = np.arange(blocks, dtype=np.int64)
    local = idx * 2 * size
    remote = idx[::-1].copy() * 2 * size
    return local, remote, np.full(blocks, size, dtype=np.int64), 2 * size * blocks


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


# -- the target process ------------------------------------------------------------------------


def _target(backend: str, nbytes: int, conn: Any) -> None:
    async def main() -> None:
        async with IOEngine("target", IOEngineConfig(backend=backend)) as engine:
            buf = np.zeros(nbytes, dtype=np.uint8)
            engine.register_memory(buf, name="buf")
            conn.send(engine.address)
            await asyncio.get_running_loop().run_in_executor(None, conn.recv)

    asyncio.run(main())


# -- measuring ---------------------------------------------------------------------------------


async def run_batches(session: Session, op: str, lo: np.ndarray, ro: np.ndarray, sz: np.ndarray, n: int) -> None:
    call = session.batch_write if op == "write" else session.batch_read
    window: collections.deque[Transfer] = collections.deque()
    for _ in range(n):
        if len(window) >= 2:
            await window.popleft()
        window.append(call(lo, ro, sz))
    for t in window:
        await t


async def run_singles(session: Session, size: int, n: int, depth: int = 64, uids: IOEngine | None = None) -> None:
    window: collections.deque[Transfer] = collections.deque()
    span = 2 * size * depth
    for i in range(n):
        if len(window) >= depth:
            await window.popleft()
        off = (i * 2 * size) % span
        if uids is None:
            window.append(session.write(off, off, size))
        else:
            window.append(session.write(off, off, size, uid=uids.allocate_transfer_uid()))
    for t in window:
        await t


async def measure(
    backend: str, procs: int, size: int, blocks: int, target_wrs: int, profile: bool, uids: bool = False
) -> list[dict[str, Any]]:
    """Rows for one (backend, procs, size, blocks): write and read (or the single-op row when blocks == 1)."""
    lo, ro, sz, nbytes = layout(blocks, size)
    if blocks == 1:
        nbytes = 2 * size * 64
    rows = []
    child = None
    parent_conn = None
    engines: list[IOEngine] = []
    try:
        init = await IOEngine("initiator", IOEngineConfig(backend=backend)).start()
        engines.append(init)
        if procs == 2:
            parent_conn, child_conn = mp.get_context("spawn").Pipe()
            child = mp.get_context("spawn").Process(target=_target, args=(backend, nbytes, child_conn))
            child.start()
            address = await asyncio.get_running_loop().run_in_executor(None, parent_conn.recv)
        else:
            target = await IOEngine("target", IOEngineConfig(backend=backend)).start()
            engines.append(target)
            target.register_memory(np.zeros(nbytes, dtype=np.uint8), name="buf")
            address = target.address
        local = init.register_memory(np.ones(nbytes, dtype=np.uint8), name="")
        peer = await init.connect(address)
        session = await init.create_session(local, peer.memory["buf"])
        ops = (["write", "write+uid"] * 3 if uids else ["write"]) if blocks == 1 else ["write", "read"]
        for op in ops:
            n = max(4, target_wrs // blocks)
            if blocks == 1:
                await run_singles(session, size, 256)  # warm up
            else:
                await run_batches(session, op, lo, ro, sz, 2)
            prof = cProfile.Profile() if profile else None
            t_cpu = time.process_time()
            c_cpu = proc_cpu(child.pid) if child is not None and child.pid else 0.0
            t0 = time.perf_counter()
            if prof is not None:
                prof.enable()
            if blocks == 1:
                await run_singles(session, size, n, uids=init if op == "write+uid" else None)
            else:
                await run_batches(session, op, lo, ro, sz, n)
            if prof is not None:
                prof.disable()
            wall = time.perf_counter() - t0
            cpu = time.process_time() - t_cpu
            target_cpu = proc_cpu(child.pid) - c_cpu if child is not None and child.pid else 0.0
            wrs = n * blocks
            row = {
                "backend": backend,
                "procs": procs,
                "op": op if blocks > 1 else f"single {op}, 64 in flight",
                "size": size,
                "blocks": blocks,
                "wrs": wrs,
                "cpu_us_per_wr": 1e6 * cpu / wrs,
                "target_cpu_us_per_wr": 1e6 * target_cpu / wrs if procs == 2 else None,
                "wall_us_per_wr": 1e6 * wall / wrs,
                "ops_per_s": wrs / wall,
                "gb_per_s": wrs * size / wall / 1e9,
            }
            if prof is not None:
                row["layers"] = by_layer(prof)
            rows.append(row)
    finally:
        for engine in reversed(engines):
            await engine.close()
        if parent_conn is not None:
            parent_conn.send("stop")
        if child is not None:
            child.join(10)
    return rows


def by_layer(prof: cProfile.Profile) -> dict[str, float]:
    """Share of the profiled CPU time (self time) per layer of the stack."""
    stats = pstats.Stats(prof)
    shares: dict[str, float] = collections.Counter()
    for (filename, _, _), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        shares[layer_of(filename)] += tottime
    total = sum(shares.values()) or 1.0
    return {k: round(v / total, 3) for k, v in sorted(shares.items(), key=lambda kv: -kv[1])}


def layer_of(filename: str) -> str:
    path = filename.replace(os.sep, "/")
    if "moriio_async/" in path:
        part = path.split("moriio_async/", 1)[1].split("/")
        if part[0] == "backends" and len(part) > 1:
            return "backends/" + part[1].removesuffix(".py")
        return part[0].removesuffix(".py")
    if "numpy" in path:
        return "numpy"
    if "asyncio" in path or "uvloop" in path or filename.startswith("<built-in method select") or "selectors" in path:
        return "event loop"
    return "other (builtins, threading)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="mock,tcp")
    ap.add_argument("--procs", default="1,2", help="1: both engines in this process; 2: target in a child")
    ap.add_argument("--sizes", nargs="+", default=["4K", "64K"])
    ap.add_argument("--blocks", nargs="+", type=int, default=[1, 64, 1024])
    ap.add_argument("--wrs", type=int, default=16384, help="work requests per row (about)")
    ap.add_argument("--profile", action="store_true", help="cProfile the rows and split CPU by layer")
    ap.add_argument("--uids", action="store_true", help="single-op rows also with a transfer uid per write")
    ap.add_argument("--against", help="a source tree to compare the single-op row with (before/after)")
    ap.add_argument("--rounds", type=int, default=6, help="alternating rounds per tree with --against")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument(
        "--mock-no-copy",
        action="store_true",
        help="diagnostic: the mock skips the byte copy of uniform chunks (the runtime's cost without the bytes)",
    )
    args = ap.parse_args(argv)
    if args.mock_no_copy:
        from moriio_async.backends.mock import qp as mock_qp

        mock_qp.copy_equal = lambda *_: None  # type: ignore[assignment]
    if args.against:
        return compare_trees(args.against, args.rounds, args.wrs)
    rows: list[dict[str, Any]] = []
    for backend in args.backends.split(","):
        for procs in (int(p) for p in args.procs.split(",")):
            if backend == "mock" and procs == 2:
                continue  # the mock NIC connects engines of one process only
            for size in (parse_size(s) for s in args.sizes):
                for blocks in args.blocks:
                    got = asyncio.run(measure(backend, procs, size, blocks, args.wrs, args.profile, args.uids))
                    for row in got:
                        print_row(row)
                    rows += got
                    if args.uids and blocks == 1:
                        print_uid_ratio(got)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def compare_trees(other: str, rounds: int, wrs: int) -> int:
    """The single-op row in child processes, alternating ``other``'s package and this one's (each round's
    ratio pairs the two runs next to each other)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cpu: dict[str, list[float]] = {other: [], here: []}
    argv = ["--backends", "mock", "--procs", "1", "--sizes", "4K", "--blocks", "1", "--wrs", str(wrs)]
    for i in range(rounds):
        for tree in (other, here) if i % 2 == 0 else (here, other):  # ABBA: neither always runs first
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                env = {**os.environ, "PYTHONPATH": tree}
                subprocess.run([sys.executable, __file__, *argv, "--json", out.name], env=env, check=True,
                               stdout=subprocess.DEVNULL)  # fmt: skip
                with open(out.name) as f:
                    cpu[tree].append(json.load(f)[0]["cpu_us_per_wr"])
    ratios = [h / o for h, o in zip(cpu[here], cpu[other], strict=True)]
    for tree, values in cpu.items():
        print(f"{tree}: cpu us/wr {' '.join(f'{v:.1f}' for v in values)}  median {statistics.median(values):.2f}")
    per_round = " ".join(f"{r:.3f}" for r in ratios)
    print(f"this tree / {other}, per round: {per_round}  median {statistics.median(ratios):.3f}")
    return 0


def print_uid_ratio(rows: list[dict[str, Any]]) -> None:
    """Median CPU per write with a uid over without, from the alternating rounds of one run."""
    plain = sorted(r["cpu_us_per_wr"] for r in rows if "uid" not in r["op"])
    with_uid = sorted(r["cpu_us_per_wr"] for r in rows if "uid" in r["op"])
    ratio = with_uid[len(with_uid) // 2] / plain[len(plain) // 2]
    print(f"      uid / no uid, median cpu per write: {ratio:.3f}", flush=True)


def print_row(r: dict[str, Any]) -> None:
    target = f" target {r['target_cpu_us_per_wr']:6.2f}" if r["target_cpu_us_per_wr"] is not None else " " * 14
    print(
        f"{r['backend']:5} {r['procs']}p {r['op']:31} {r['size'] >> 10:5}K x{r['blocks']:<5}"
        f" cpu {r['cpu_us_per_wr']:6.2f} us/wr{target}  wall {r['wall_us_per_wr']:6.2f} us/wr"
        f"  {r['ops_per_s'] / 1e3:7.1f}k wr/s {r['gb_per_s']:6.2f} GB/s",
        flush=True,
    )
    if "layers" in r:
        print("      by layer: " + ", ".join(f"{k} {v:.0%}" for k, v in r["layers"].items()), flush=True)


if __name__ == "__main__":
    sys.exit(main())
