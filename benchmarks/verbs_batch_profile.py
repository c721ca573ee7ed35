"""Where a verbs batch's time goes: cProfile of batch_writes on rxe, inside the Soft-RoCE guest.

    python3 tools/guest/run.py -- sh -c \\
        'PYTHONPATH=$PWD:$PYTHONPATH python3 benchmarks/verbs_batch_profile.py --blocks 1024 --size 4096 --batches 4'

Two engines in two processes on rxe0 (the target as in verbs_vs_perftest.py), the initiator
profiled while it writes ``batches`` batches of ``blocks`` non-contiguous blocks, two in flight.
Prints the wall and process CPU time per work request and the top functions by their own time.
The extended-QP section (``_pyverbs/qp.py`` ``_section``) includes rxe's own work, which on one
device runs inside the doorbell's system call. ``--unaligned`` uses a plain numpy buffer (16 bytes
into a page) on the initiator's side instead of a page-aligned one.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import multiprocessing as mp
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import verbs_vs_perftest as bench


async def run(args: argparse.Namespace, prof: cProfile.Profile) -> None:
    import numpy as np

    from moriio_async import IOEngine, IOEngineConfig, VerbsOptions

    region = 2 * args.blocks * args.size
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=bench._target, args=(region, "rxe0", child))
    proc.start()
    try:
        address = parent.recv()
        local = np.zeros(region, dtype=np.uint8) if args.unaligned else bench.page_aligned(region)
        async with IOEngine(
            "bench", IOEngineConfig(backend="verbs", verbs=VerbsOptions(device="rxe0"), sq_depth=256)
        ) as engine:
            desc = engine.register_memory(local, name="kv")
            peer = await engine.connect(address)
            session = await engine.create_session(desc, peer.memory["kv"])
            await bench.batched(session, "write", args.size, args.blocks, 2 * args.blocks, 2)  # warm-up
            n = args.blocks * args.batches
            prof.enable()
            cpu = time.process_time()
            secs = await bench.batched(session, "write", args.size, args.blocks, n, 2)
            cpu = time.process_time() - cpu
            prof.disable()
            print(f"verbs_batch_profile: {n} work requests in {secs:.2f} s: {1e6 * secs / n:.0f} us each wall, "
                  f"{1e6 * cpu / n:.0f} us process CPU", flush=True)  # fmt: skip
            await engine.notify("bench-target", b"done")
    finally:
        proc.join(15)
        if proc.is_alive():
            proc.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=1024)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--unaligned", action="store_true")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    prof = cProfile.Profile()
    asyncio.run(run(args, prof))
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
