"""moriio_async over verbs beside perftest's ib_write_bw / ib_read_bw, on one Soft-RoCE device.

Runs INSIDE the QEMU guest (tools/guest), never on the host:

    python3 tools/guest/run.py --timeout 1500 -- python3 benchmarks/verbs_vs_perftest.py
    python3 tools/guest/run.py -- python3 benchmarks/verbs_vs_perftest.py --sizes 64K --iters 100

For each message size, perftest runs first (server and client as two processes on the same rxe
device, which loops the traffic internally; RoCE v2 IPv4 GID; ``-t`` = the same number in
flight), then moriio_async with two engines in two processes (a target that registers a buffer,
an initiator on ``backend="verbs"``) in two shapes:

* single: one block per ``session.write`` / ``session.read``, that many outstanding;
* batch N: ``session.batch_write`` / ``batch_read`` of N non-contiguous blocks (every other block
  on both sides, so nothing merges: one work request per block), two batches in flight.

Both report MiB/s and operations (blocks) per second; the ratio moriio_async / perftest for the
same operation and block size is the figure to track: emulation makes the absolute numbers
meaningless. The table is printed and the rows go to ``$MORIIO_GUEST_OUT/verbs_vs_perftest.json``.

    python3 tools/guest/run.py --timeout 1500 -- python3 benchmarks/verbs_vs_perftest.py \
        --sizes 4K 64K --batches 64 1024
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

UNITS = {"K": 1 << 10, "M": 1 << 20}
MIB = 1 << 20
PAGE = 4096
# Iterations per size when --iters is not given: small, because under TCG emulation a 4 KiB
# operation costs milliseconds (see tools/guest/PYVERBS_NOTES.md). Measured: the whole run takes
# about 1.5 min of guest time (2.5 min with the boot).
DEFAULT_ITERS = {4 << 10: 2000, 64 << 10: 300, 1 << 20: 40}
# Blocks per batch measurement (a whole number of batches, at least two), per block size.
DEFAULT_BATCH_BLOCKS = {4 << 10: 4096, 64 << 10: 2048, 1 << 20: 128}
BATCH_WINDOW = 2


def parse_size(text: str) -> int:
    return int(text[:-1]) * UNITS[text[-1].upper()] if text[-1].upper() in UNITS else int(text)


def label(size: int) -> str:
    return f"{size >> 20} MiB" if size >= MIB else f"{size >> 10} KiB"


def roce_v2_ipv4_gid(device: str, port: int = 1) -> int:
    """The GID index of the RoCE v2 IPv4-mapped entry (what pair_perftest.sh picks)."""
    base = Path(f"/sys/class/infiniband/{device}/ports/{port}")
    for path in sorted((base / "gids").iterdir(), key=lambda p: int(p.name)):
        try:
            gid = path.read_text().strip()
            kind = (base / "gid_attrs" / "types" / path.name).read_text().strip()
        except OSError:
            continue
        if gid.startswith("0000:0000:0000:0000:0000:ffff:") and kind == "RoCE v2":
            return int(path.name)
    raise SystemExit(f"verbs_vs_perftest: no RoCE v2 IPv4 GID on {device}")


# -- perftest ------------------------------------------------------------------------------------

_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$", re.M)


def perftest(tool: str, size: int, iters: int, depth: int, args: argparse.Namespace, port: int) -> dict[str, Any]:
    """One ib_*_bw server + client pair on the same device; average MiB/s and msg/s of the client."""
    opts = [tool, "-d", args.device, "-i", "1", "-x", str(args.gid_index), "-s", str(size), "-n", str(iters)]
    opts += ["-t", str(depth), "-p", str(port), "-F"]
    server = subprocess.Popen(opts, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = ""
    start = time.monotonic()
    try:
        for _ in range(60):  # the server may not listen yet: retry the client's TCP exchange
            time.sleep(0.5)
            client = subprocess.run([*opts, args.ip], capture_output=True, text=True, timeout=args.step_timeout)
            out = client.stdout + client.stderr
            if client.returncode == 0 or server.poll() is not None:
                break
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        out += f"\n(timed out after {args.step_timeout} s)"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    elapsed = time.monotonic() - start
    rows = [m for m in _ROW.finditer(out) if int(m.group(1)) == size]
    if not rows:
        print(f"{tool} {label(size)}: no result\n{out}", flush=True)
        return {"error": out[-2000:], "wall_s": round(elapsed, 1)}
    _, n, _peak, avg, mpps = rows[-1].groups()
    return {"MiBps": float(avg), "ops_per_s": float(mpps) * 1e6, "iters": int(n), "wall_s": round(elapsed, 1)}


# -- moriio_async --------------------------------------------------------------------------------


def page_aligned(size: int, fill: int = 0) -> Any:
    """A numpy buffer starting on a page, as perftest's are. (A plain numpy array starts 16 bytes
    into a page, so every 4 KiB block would straddle two pages and rxe would copy each in two pieces.)"""
    import numpy as np

    raw = np.full(size + PAGE, fill, dtype=np.uint8)
    skip = -raw.ctypes.data % PAGE
    return raw[skip : skip + size]


def _target(region: int, device: str, pipe: Any) -> None:
    from moriio_async import IOEngine, IOEngineConfig, VerbsOptions

    async def main() -> None:
        buf = page_aligned(region, 1)
        async with IOEngine(
            "bench-target", IOEngineConfig(backend="verbs", verbs=VerbsOptions(device=device))
        ) as engine:
            engine.register_memory(buf, name="kv")
            pipe.send(engine.address)
            await engine.recv_notification()

    asyncio.run(main())


async def windowed(session: Any, op: str, block: int, depth: int, count: int, region: int) -> float:
    """Seconds for ``count`` single-block operations with ``depth`` outstanding."""
    call = session.read if op == "read" else session.write
    window: collections.deque[Any] = collections.deque()
    slots = max(region // block, 1)
    start = time.perf_counter()
    for i in range(count):
        off = (i % slots) * block
        window.append(call(off, off, block))
        if len(window) >= depth:
            await window.popleft()
    while window:
        await window.popleft()
    return time.perf_counter() - start


async def batched(session: Any, op: str, block: int, n: int, total: int, window: int) -> float:
    """Seconds for ``total`` blocks as batches of ``n`` non-contiguous blocks, ``window`` batches outstanding."""
    import numpy as np

    offsets = np.arange(n, dtype=np.int64) * (2 * block)  # every other block: nothing merges
    sizes = np.full(n, block, dtype=np.int64)
    call = session.batch_read if op == "read" else session.batch_write
    pending: collections.deque[Any] = collections.deque()
    start = time.perf_counter()
    for _ in range(max(total // n, 1)):
        pending.append(call(offsets, offsets, sizes))
        if len(pending) >= window:
            await pending.popleft()
    while pending:
        await pending.popleft()
    return time.perf_counter() - start


def _record(
    results: dict[tuple[str, int, str], Any], key: tuple[str, int, str], count: int, size: int, secs: float
) -> None:
    results[key] = r = {"MiBps": count * size / secs / MIB, "ops_per_s": count / secs, "iters": count,
                        "wall_s": round(secs, 2)}  # fmt: skip
    kind, _, op = key
    print(
        f"moriio_async {kind:<10} {op:<5} {label(size):>7}: {r['MiBps']:9.2f} MiB/s {r['ops_per_s']:9.1f} op/s"
        f"  ({count} in {secs:.1f} s)",
        flush=True,
    )


async def moriio(
    plan: list[tuple[int, int]], batch_plan: list[tuple[int, int, int]], depth: int, args: argparse.Namespace
) -> dict[tuple[str, int, str], Any]:
    """Single-op rows keyed ("single", size, op); batch rows keyed ("batch N", size, op)."""

    from moriio_async import IOEngine, IOEngineConfig, VerbsOptions

    region = max([size * depth for size, _ in plan] + [2 * n * size for n, size, _ in batch_plan] + [4096 * depth])
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(region, args.device, child))
    proc.start()
    results: dict[tuple[str, int, str], Any] = {}
    try:
        if not parent.poll(args.step_timeout):
            raise RuntimeError("the target process did not start")
        address = parent.recv()
        local = page_aligned(region)
        config = IOEngineConfig(backend="verbs", verbs=VerbsOptions(device=args.device), sq_depth=256)
        async with IOEngine("bench", config) as engine:
            desc = engine.register_memory(local, name="kv")
            peer = await engine.connect(address)
            session = await engine.create_session(desc, peer.memory["kv"])
            for op in ("write", "read"):  # warm-up: QP and the first completions
                await windowed(session, op, 4096, depth, depth, region)
            for size, iters in plan:
                for op in ("write", "read"):
                    secs = await asyncio.wait_for(windowed(session, op, size, depth, iters, region), args.step_timeout)
                    _record(results, ("single", size, op), iters, size, secs)
            for n, size, total in batch_plan:
                for op in ("write", "read"):
                    coro = batched(session, op, size, n, total, BATCH_WINDOW)
                    secs = await asyncio.wait_for(coro, args.step_timeout)
                    _record(results, (f"batch {n}", size, op), max(total // n, 1) * n, size, secs)
            await engine.notify("bench-target", b"done")
    finally:
        proc.join(15)
        if proc.is_alive():
            proc.kill()
    return results


# -- table ---------------------------------------------------------------------------------------


def table(rows: list[dict[str, Any]]) -> str:
    def num(value: Any, fmt: str) -> str:
        return format(value, fmt) if isinstance(value, (int, float)) else "n/a"

    lines = [
        "| op | shape | size | ops | perftest MiB/s | moriio_async MiB/s | perftest op/s | moriio_async op/s | ratio |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['op']} | {r['shape']} | {label(r['size'])} | {r['iters']} | {num(r['perftest_MiBps'], '.2f')} "
            f"| {num(r['moriio_MiBps'], '.2f')} | {num(r['perftest_ops'], '.0f')} | {num(r['moriio_ops'], '.0f')} "
            f"| {num(r['ratio'], '.2f')} |"
        )
    return "\n".join(lines)


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["4K", "64K", "1M"])
    parser.add_argument("--iters", type=int, help="iterations per measurement (default: per size, see DEFAULT_ITERS)")
    parser.add_argument("--depth", type=int, default=16, help="operations in flight (perftest -t)")
    parser.add_argument("--batches", nargs="*", type=int, default=[64, 1024], help="blocks per batch (none: skip)")
    parser.add_argument("--batch-sizes", nargs="*", default=["4K", "64K"], help="block sizes of the batch rows")
    parser.add_argument("--batch-blocks", type=int, help="blocks per batch measurement (default: DEFAULT_BATCH_BLOCKS)")
    parser.add_argument("--no-single", action="store_true", help="skip the single-op rows")
    parser.add_argument("--step-timeout", type=float, default=180.0, help="seconds allowed per measurement")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of perftest then moriio_async (medians too)")
    parser.add_argument("--json", help="default: $MORIIO_GUEST_OUT/verbs_vs_perftest.json")
    args = parser.parse_args(argv)
    if not os.environ.get("MORIIO_GUEST"):
        print(
            "verbs_vs_perftest: runs inside the Soft-RoCE guest only (MORIIO_GUEST is unset). Run:\n"
            "    python3 tools/guest/run.py --timeout 1500 -- python3 benchmarks/verbs_vs_perftest.py",
            file=sys.stderr,
        )
        return 2
    args.device = os.environ.get("MORIIO_GUEST_DEVICE", "rxe0")
    args.ip = os.environ.get("MORIIO_GUEST_SELF_IP", "10.77.1.1")
    args.gid_index = roce_v2_ipv4_gid(args.device)
    args.port = 18515  # perftest's TCP port: a new one per run
    sizes = [parse_size(s) for s in args.sizes]
    plan = [] if args.no_single else [(size, max(args.iters or DEFAULT_ITERS.get(size, 100), 5)) for size in sizes]
    batch_sizes = [parse_size(s) for s in args.batch_sizes]
    batch_plan = [
        (n, size, max(args.batch_blocks or DEFAULT_BATCH_BLOCKS.get(size, 256), 2 * n))
        for size in batch_sizes
        for n in args.batches
    ]
    perf_plan = {size: max(args.iters or DEFAULT_ITERS.get(size, 100), 5) for size in [*sizes, *batch_sizes]}
    print(
        f"verbs_vs_perftest: {args.device} gid {args.gid_index} ip {args.ip} depth {args.depth} "
        f"single {[(label(s), n) for s, n in plan]} batches {[(n, label(s), t) for n, s, t in batch_plan]}, "
        f"python {sys.version.split()[0]}",
        flush=True,
    )
    began = time.monotonic()
    rounds = []
    for n in range(args.repeat):
        if args.repeat > 1:
            print(f"verbs_vs_perftest: round {n + 1} of {args.repeat}", flush=True)
        rows = one_round(args, plan, batch_plan, perf_plan)
        print(table(rows), flush=True)
        rounds.append(rows)
    if args.repeat > 1:
        print(f"verbs_vs_perftest: median of {args.repeat} rounds (perftest and moriio_async alternate)", flush=True)
        print(table(median_rows(rounds)), flush=True)
    print(f"verbs_vs_perftest: {time.monotonic() - began:.0f} s in the guest", flush=True)
    out = args.json or os.path.join(os.environ.get("MORIIO_GUEST_OUT", "."), "verbs_vs_perftest.json")
    with open(out, "w") as f:
        json.dump({"device": args.device, "gid_index": args.gid_index, "rounds": rounds}, f, indent=1)
    return 0 if all(r["ratio"] is not None for rows in rounds for r in rows) else 1


def one_round(
    args: argparse.Namespace,
    plan: list[tuple[int, int]],
    batch_plan: list[tuple[int, int, int]],
    perf_plan: dict[int, int],
) -> list[dict[str, Any]]:
    """perftest for every size, then moriio_async for every shape: the rows of one table."""
    perf: dict[tuple[int, str], Any] = {}
    for size, iters in perf_plan.items():
        for op in ("write", "read"):
            t0 = time.monotonic()
            perf[(size, op)] = r = perftest(f"ib_{op}_bw", size, iters, args.depth, args, args.port)
            args.port += 1
            if "MiBps" in r:
                print(
                    f"perftest     {op:<5} {label(size):>7}: {r['MiBps']:9.2f} MiB/s {r['ops_per_s']:9.1f} op/s"
                    f"  ({iters} in {time.monotonic() - t0:.1f} s wall)",
                    flush=True,
                )
    try:
        mine = asyncio.run(moriio(plan, batch_plan, args.depth, args))
    except Exception as exc:  # keep perftest's figures even when moriio_async fails
        print(f"moriio_async failed: {exc!r}", flush=True)
        mine = {}
    rows = []
    shapes = [("single", size, iters) for size, iters in plan]
    shapes += [(f"batch {n}", size, max(total // n, 1) * n) for n, size, total in batch_plan]
    for shape, size, iters in shapes:
        for op in ("write", "read"):
            p, m = perf.get((size, op), {}), mine.get((shape, size, op), {})
            ratio = m["MiBps"] / p["MiBps"] if "MiBps" in m and p.get("MiBps") else None
            rows.append(
                {
                    "op": op,
                    "shape": shape,
                    "size": size,
                    "iters": iters,
                    "depth": args.depth,
                    "perftest_MiBps": p.get("MiBps"),
                    "moriio_MiBps": _round(m.get("MiBps")),
                    "perftest_ops": _round(p.get("ops_per_s")),
                    "moriio_ops": _round(m.get("ops_per_s")),
                    "ratio": _round(ratio, 3),
                    "perftest_error": p.get("error"),
                }
            )
    return rows


def median_rows(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per row, the median of each figure over the rounds (the ratio is the median of the rounds' ratios)."""
    out = []
    for same in zip(*rounds, strict=True):
        row = dict(same[0])
        for key in ("perftest_MiBps", "moriio_MiBps", "perftest_ops", "moriio_ops", "ratio"):
            values = [r[key] for r in same if r[key] is not None]
            row[key] = statistics.median(values) if values else None
        out.append(row)
    return out


if __name__ == "__main__":
    sys.exit(main())
