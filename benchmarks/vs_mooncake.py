"""moriio_async's TCP backend beside Mooncake Transfer Engine's TCP transport, in one run (ratios).

    pip install mooncake-transfer-engine-non-cuda      # or: pip install 'moriio-async[bench]'
    python benchmarks/vs_mooncake.py                   # 64 KiB x 128, 1 MiB x 16, 16 MiB x 4
    python benchmarks/vs_mooncake.py --rounds 5 --json out.json

Both systems run as users run them, two processes on loopback each: a target
process registers a 256 MiB buffer; the initiator (this process) registers its
own and moves batches of non-contiguous blocks (shuffled offsets, a gap after
every block) with one call per batch and one batch in flight: moriio_async's
``session.batch_write``/``batch_read`` awaited, Mooncake's
``batch_transfer_sync_write``/``batch_transfer_sync_read`` (its Python API is
synchronous; P2P handshake, no metadata server). The two alternate, round by
round, so load on the machine hits both alike; each cell is the median round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from moriio_async import IOEngine, IOEngineConfig, Session

REGION = 256 << 20
CASES = [(64 << 10, 128), (1 << 20, 16), (16 << 20, 4)]


def offsets(n: int, size: int, seed: int) -> list[int]:
    slots = REGION // (2 * size)
    return [int(x) * 2 * size for x in np.random.default_rng(seed).permutation(slots)[:n]]


# -- targets (their own processes) ---------------------------------------------------------------


def _moriio_target(pipe: Any) -> None:
    async def main() -> None:
        buf = np.full(REGION, 3, dtype=np.uint8)
        async with IOEngine("bench-target", IOEngineConfig(backend="tcp")) as engine:
            engine.register_memory(buf, name="kv")
            pipe.send(engine.address)
            await engine.recv_notification()

    asyncio.run(main())


def _mooncake_target(pipe: Any) -> None:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""):
        raise SystemExit("mooncake: initialize failed")
    buf = np.full(REGION, 3, dtype=np.uint8)
    if engine.register_memory(buf.ctypes.data, buf.nbytes):
        raise SystemExit("mooncake: register_memory failed")
    pipe.send({"session": f"127.0.0.1:{engine.get_rpc_port()}", "addr": buf.ctypes.data})
    pipe.recv()  # until the initiator is done


# -- one batch each ------------------------------------------------------------------------------


async def moriio_batch(session: Session, op: str, local: list[int], remote: list[int], size: int) -> float:
    call = session.batch_write if op == "write" else session.batch_read
    start = time.perf_counter()
    await call(local, remote, [size] * len(local))
    return time.perf_counter() - start


def mooncake_batch(engine: Any, target: dict[str, Any], base: int, op: str, local: list[int], remote: list[int],
                   size: int) -> float:  # fmt: skip
    call = engine.batch_transfer_sync_write if op == "write" else engine.batch_transfer_sync_read
    start = time.perf_counter()
    rc = call(target["session"], [base + o for o in local], [target["addr"] + o for o in remote], [size] * len(local))
    elapsed = time.perf_counter() - start
    if rc != 0:
        raise RuntimeError(f"mooncake {op} batch failed: {rc}")
    return elapsed


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from mooncake.engine import TransferEngine

    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for target in (_moriio_target, _mooncake_target):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=target, args=(child,))
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    rows: list[dict[str, Any]] = []
    try:
        address, mc_target = pipes[0].recv(), pipes[1].recv()
        mc = TransferEngine()
        if mc.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""):
            raise SystemExit("mooncake: initialize failed")
        mc_buf = np.ones(REGION, dtype=np.uint8)
        if mc.register_memory(mc_buf.ctypes.data, mc_buf.nbytes):
            raise SystemExit("mooncake: register_memory failed")
        local = np.ones(REGION, dtype=np.uint8)
        async with IOEngine("bench", IOEngineConfig(backend="tcp", sq_depth=1024)) as engine:
            desc = engine.register_memory(local, name="kv")
            peer = await engine.connect(address)
            session = await engine.create_session(desc, peer.memory["kv"])
            for size, n in CASES:
                for op in ("write", "read"):
                    mine: list[float] = []
                    theirs: list[float] = []
                    for r in range(args.rounds + 1):  # round 0 warms both up (connections, pages)
                        lo, ro = offsets(n, size, 2 * r), offsets(n, size, 2 * r + 1)
                        reps = max(1, args.bytes // (n * size))
                        t_m = sum([await moriio_batch(session, op, lo, ro, size) for _ in range(reps)])
                        t_c = sum(
                            mooncake_batch(mc, mc_target, mc_buf.ctypes.data, op, lo, ro, size) for _ in range(reps)
                        )
                        if r:
                            mine.append(reps * n * size / t_m / 1e9)
                            theirs.append(reps * n * size / t_c / 1e9)
                    m, c = statistics.median(mine), statistics.median(theirs)
                    row = {"block": size, "blocks": n, "op": op, "moriio_GBps": round(m, 3),
                           "mooncake_GBps": round(c, 3), "ratio": round(m / c, 3)}  # fmt: skip
                    rows.append(row)
                    print(f"{size >> 10:>6} KiB x {n:<4} {op:<5}  moriio_async {m:6.2f}  mooncake {c:6.2f} GB/s  "
                          f"ratio {m / c:5.2f}", flush=True)  # fmt: skip
            await engine.notify("bench-target", b"done")
        pipes[1].send("done")
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per cell (median)")
    parser.add_argument("--bytes", type=int, default=64 << 20, help="bytes per system per round")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake logs every connection at INFO
    try:
        import mooncake.engine  # noqa: F401
    except ImportError:
        print("needs Mooncake: pip install mooncake-transfer-engine-non-cuda", file=sys.stderr)
        return 2
    print(f"moriio_async tcp vs Mooncake Transfer Engine tcp, two processes each, python {sys.version.split()[0]}")
    rows = asyncio.run(run(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
