"""moriio_async over verbs beside perftest's ib_write_bw / ib_read_bw, on one Soft-RoCE device.

Runs INSIDE the QEMU guest (tools/guest), never on the host:

    python3 tools/guest/run.py --timeout 900 -- python3 benchmarks/verbs_vs_perftest.py
    python3 tools/guest/run.py -- python3 benchmarks/verbs_vs_perftest.py --sizes 64K --iters 100

For each message size, perftest runs first (server and client as two processes on the same rxe
device, which loops the traffic internally; RoCE v2 IPv4 GID; ``-t`` = the same number in
flight), then moriio_async with two engines in two processes (a target that registers a buffer,
an initiator that issues single-block ``session.write`` / ``session.read`` keeping that many
outstanding) over ``backend="verbs"``. Both report MiB/s and operations per second; the ratio
moriio_async / perftest is the figure to track: emulation makes the absolute numbers meaningless.
The table is printed and the rows go to ``$MORIIO_GUEST_OUT/verbs_vs_perftest.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

UNITS = {"K": 1 << 10, "M": 1 << 20}
MIB = 1 << 20
# Iterations per size when --iters is not given: small, because under TCG emulation a 4 KiB
# operation costs milliseconds (see tools/guest/PYVERBS_NOTES.md). Measured: the whole run takes
# about 1.5 min of guest time (2.5 min with the boot).
DEFAULT_ITERS = {4 << 10: 2000, 64 << 10: 300, 1 << 20: 40}


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


def _target(region: int, device: str, pipe: Any) -> None:
    import numpy as np

    from moriio_async import IOEngine, IOEngineConfig

    async def main() -> None:
        buf = np.ones(region, dtype=np.uint8)
        async with IOEngine("bench-target", IOEngineConfig(backend="verbs", device=device)) as engine:
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


async def moriio(plan: list[tuple[int, int]], depth: int, args: argparse.Namespace) -> dict[tuple[int, str], Any]:
    import numpy as np

    from moriio_async import IOEngine, IOEngineConfig

    region = max(size for size, _ in plan) * depth
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(region, args.device, child))
    proc.start()
    results: dict[tuple[int, str], Any] = {}
    try:
        if not parent.poll(args.step_timeout):
            raise RuntimeError("the target process did not start")
        address = parent.recv()
        local = np.zeros(region, dtype=np.uint8)
        config = IOEngineConfig(backend="verbs", device=args.device, sq_depth=256)
        async with IOEngine("bench", config) as engine:
            desc = engine.register_memory(local, name="kv")
            peer = await engine.connect(address)
            session = await engine.create_session(desc, peer.memory["kv"])
            for op in ("write", "read"):  # warm-up: QP and the first completions
                await windowed(session, op, 4096, depth, depth, region)
            for size, iters in plan:
                for op in ("write", "read"):
                    secs = await asyncio.wait_for(windowed(session, op, size, depth, iters, region), args.step_timeout)
                    results[(size, op)] = {
                        "MiBps": iters * size / secs / MIB,
                        "ops_per_s": iters / secs,
                        "iters": iters,
                        "wall_s": round(secs, 2),
                    }
                    r = results[(size, op)]
                    print(
                        f"moriio_async {op:<5} {label(size):>7}: {r['MiBps']:9.2f} MiB/s {r['ops_per_s']:9.1f} op/s"
                        f"  ({iters} in {secs:.1f} s)",
                        flush=True,
                    )
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
        "| op | size | iters | perftest MiB/s | moriio_async MiB/s | perftest op/s | moriio_async op/s | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['op']} | {label(r['size'])} | {r['iters']} | {num(r['perftest_MiBps'], '.2f')} "
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
    parser.add_argument("--step-timeout", type=float, default=180.0, help="seconds allowed per measurement")
    parser.add_argument("--json", help="default: $MORIIO_GUEST_OUT/verbs_vs_perftest.json")
    args = parser.parse_args(argv)
    if not os.environ.get("MORIIO_GUEST"):
        print(
            "verbs_vs_perftest: runs inside the Soft-RoCE guest only (MORIIO_GUEST is unset). Run:\n"
            "    python3 tools/guest/run.py --timeout 900 -- python3 benchmarks/verbs_vs_perftest.py",
            file=sys.stderr,
        )
        return 2
    args.device = os.environ.get("MORIIO_GUEST_DEVICE", "rxe0")
    args.ip = os.environ.get("MORIIO_GUEST_SELF_IP", "10.77.1.1")
    args.gid_index = roce_v2_ipv4_gid(args.device)
    sizes = [parse_size(s) for s in args.sizes]
    plan = [(size, max(args.iters or DEFAULT_ITERS.get(size, 100), 5)) for size in sizes]
    print(
        f"verbs_vs_perftest: {args.device} gid {args.gid_index} ip {args.ip} depth {args.depth} "
        f"plan {[(label(s), n) for s, n in plan]}, python {sys.version.split()[0]}",
        flush=True,
    )
    began = time.monotonic()
    perf: dict[tuple[int, str], Any] = {}
    port = 18515
    for size, iters in plan:
        for op in ("write", "read"):
            t0 = time.monotonic()
            perf[(size, op)] = r = perftest(f"ib_{op}_bw", size, iters, args.depth, args, port)
            port += 1
            if "MiBps" in r:
                print(
                    f"perftest     {op:<5} {label(size):>7}: {r['MiBps']:9.2f} MiB/s {r['ops_per_s']:9.1f} op/s"
                    f"  ({iters} in {time.monotonic() - t0:.1f} s wall)",
                    flush=True,
                )
    try:
        mine = asyncio.run(moriio(plan, args.depth, args))
    except Exception as exc:  # keep perftest's figures even when moriio_async fails
        print(f"moriio_async failed: {exc!r}", flush=True)
        mine = {}
    rows = []
    for size, iters in plan:
        for op in ("write", "read"):
            p, m = perf.get((size, op), {}), mine.get((size, op), {})
            ratio = m["MiBps"] / p["MiBps"] if "MiBps" in m and p.get("MiBps") else None
            rows.append(
                {
                    "op": op,
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
    print(table(rows), flush=True)
    print(f"verbs_vs_perftest: {time.monotonic() - began:.0f} s in the guest", flush=True)
    out = args.json or os.path.join(os.environ.get("MORIIO_GUEST_OUT", "."), "verbs_vs_perftest.json")
    with open(out, "w") as f:
        json.dump({"device": args.device, "gid_index": args.gid_index, "rows": rows}, f, indent=1)
    return 0 if all(r["ratio"] is not None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
