"""MoRI-IO's own waiting idiom, ``while status.InProgress(): pass``, against ``status.Wait()``, on compat engines.

    python benchmarks/compat_spin.py                          # tcp and cma, 8 KiB READs, 400 rounds each
    python benchmarks/compat_spin.py --backends tcp --size 65536 --rounds 1000 --json out.json

Two ``moriio_async.compat.mori`` engines in this process (each with its loop thread, as two vLLM workers would
have), one session between them, qp_per_transfer=1. Each round issues one READ waited with ``Wait()`` and one
waited by spinning on ``InProgress()`` from this (the main) thread, in alternating order, so both see the same
machine. Latency is from the ``read`` call to the end of the wait. ``spin/Wait`` is the ratio of the medians
(and of the p99s); ``checks`` is the median number of ``InProgress()`` calls a spinning wait made.
``rare check`` is the median cost of one ``InProgress()`` on a status in progress, made 200 us after the
thread's previous check (what a caller that polls now and then pays).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

from moriio_async import IOEngineConfig as AsyncEngineConfig
from moriio_async.compat.mori import (
    BackendType,
    IOEngine,
    IOEngineConfig,
    RdmaBackendConfig,
    StatusCode,
    TransferStatus,
)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def rare_check(samples: int = 2000) -> float:
    """Median seconds of one ``InProgress()`` on a status in progress, 200 us after the previous check."""
    status = TransferStatus()
    status.SetCode(StatusCode.IN_PROGRESS)
    took = []
    for _ in range(samples):
        time.sleep(200e-6)
        t0 = time.perf_counter()
        status.InProgress()
        took.append(time.perf_counter() - t0)
    return statistics.median(took)


def run(backend: str, size: int, rounds: int) -> dict[str, Any]:
    config = IOEngineConfig("127.0.0.1", 0, options=AsyncEngineConfig(backend=backend))
    a, b = IOEngine(f"spin-{backend}-a", config), IOEngine(f"spin-{backend}-b", config)
    try:
        for engine in (a, b):
            engine.create_backend(BackendType.RDMA, RdmaBackendConfig(qp_per_transfer=1))
        a.register_remote_engine(b.get_engine_desc())
        b.register_remote_engine(a.get_engine_desc())
        buf_a, buf_b = np.zeros(size, np.uint8), np.ones(size, np.uint8)
        mem_a, mem_b = a.register_torch_tensor(buf_a), b.register_torch_tensor(buf_b)
        session = a.create_session(mem_a, mem_b)
        assert session is not None
        wait: list[float] = []
        spin: list[float] = []
        checks: list[int] = []
        for i in range(rounds + 20):  # the first 20 rounds warm up
            for mode in ("wait", "spin") if i % 2 == 0 else ("spin", "wait"):
                t0 = time.perf_counter()
                status = session.read(0, 0, size)
                if mode == "wait":
                    status.Wait()
                    elapsed = time.perf_counter() - t0
                    if i >= 20:
                        wait.append(elapsed)
                else:
                    n = 0
                    while status.InProgress():
                        n += 1
                    elapsed = time.perf_counter() - t0
                    if i >= 20:
                        spin.append(elapsed)
                        checks.append(n + 1)
                assert status.Code() is StatusCode.SUCCESS, status.Message()
        return {
            "backend": backend,
            "size": size,
            "rounds": rounds,
            "wait_p50_us": pct(wait, 50) * 1e6,
            "wait_p99_us": pct(wait, 99) * 1e6,
            "spin_p50_us": pct(spin, 50) * 1e6,
            "spin_p99_us": pct(spin, 99) * 1e6,
            "ratio_p50": pct(spin, 50) / pct(wait, 50),
            "ratio_p99": pct(spin, 99) / pct(wait, 99),
            "checks_p50": statistics.median(checks),
            "rare_check_ns": rare_check() * 1e9,
        }
    finally:
        a.close()
        b.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="tcp,cma")
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args(argv)
    rows = [run(backend, args.size, args.rounds) for backend in args.backends.split(",") if backend]
    print(f"{'backend':8} {'size':>7} {'Wait p50':>10} {'spin p50':>10} {'spin/Wait':>9} {'Wait p99':>10} "
          f"{'spin p99':>10} {'p99 ratio':>9} {'checks':>8} {'rare check':>11}")  # fmt: skip
    for r in rows:
        print(
            f"{r['backend']:8} {r['size']:>7} {r['wait_p50_us']:>8.0f}us {r['spin_p50_us']:>8.0f}us "
            f"{r['ratio_p50']:>8.2f}x {r['wait_p99_us']:>8.0f}us {r['spin_p99_us']:>8.0f}us {r['ratio_p99']:>8.2f}x "
            f"{r['checks_p50']:>8.0f} {r['rare_check_ns']:>9.0f}ns"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
