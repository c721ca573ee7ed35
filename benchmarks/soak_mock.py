"""Soak on the mock NIC: many transfers through the runtime, with failures, and exact accounting.

    python benchmarks/soak_mock.py                   # 200,000 transfers, asyncio then uvloop
    python benchmarks/soak_mock.py --transfers 50000 --loops asyncio

(``soak.py`` is the soak between two real processes over TCP, with a fault plan and hostile
connections; this one is the runtime alone, in one process, where it is fastest and where the
mock's test seams inject failures.)

A mix of single reads/writes and batches of 1-64 scattered blocks, up to
``--window`` in flight, waited on in groups with ``waiting_for_transfer_complete``
(a short deadline now and then, so some waits time out and are waited again);
every ``--fail-every`` transfers the NIC fails the next request (the pair
enters the error state, the rest flush, the session reconnects). At the end it
checks that every transfer ended exactly once (one done callback each), that
succeeded + failed is everything, that no transfer is outstanding and nothing
stays pinned (the local region deregisters), and that every error listed each
unfinished transfer once. Prints transfers per second and CPU per transfer.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import sys
import time

import numpy as np
import uvloop

from moriio_async import IOEngine, IOEngineConfig, Transfer, TransferError, WcStatus, waiting_for_transfer_complete
from moriio_async.backends.mock import MockQueuePair

BLOCK = 4096
SLOTS = 1024


async def soak(n: int, window: int, fail_every: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    ended: collections.Counter[int] = collections.Counter()
    async with IOEngine("a", IOEngineConfig(backend="mock")) as a, IOEngine("b", IOEngineConfig(backend="mock")) as b:
        b.register_memory(np.zeros(2 * SLOTS * BLOCK, dtype=np.uint8), name="m")
        local = a.register_memory(np.ones(2 * SLOTS * BLOCK, dtype=np.uint8))
        peer = await a.connect(b.address)
        session = await a.create_session(local, peer.memory["m"])

        def count(t: Transfer) -> None:
            ended[t.id] += 1

        started: list[Transfer] = []
        batch: list[Transfer] = []
        errors = listed_twice = 0
        cpu, wall = time.process_time(), time.perf_counter()
        for i in range(n):
            if fail_every and i % fail_every == fail_every - 1:
                qp = session.channel.qp
                if isinstance(qp, MockQueuePair):
                    qp.fail_next(WcStatus.REM_ACCESS_ERR)
            if rng.random() < 0.7:
                off = 2 * BLOCK * rng.randrange(SLOTS)
                t = (session.write if rng.random() < 0.5 else session.read)(off, off, rng.choice((8, BLOCK)))
            else:
                k = rng.randint(1, 64)
                idx = np.array(rng.sample(range(SLOTS), k), dtype=np.int64) * 2 * BLOCK
                call = session.batch_write if rng.random() < 0.5 else session.batch_read
                t = call(idx, idx[::-1].copy(), np.full(k, BLOCK, dtype=np.int64))
            t.add_done_callback(count)
            started.append(t)
            batch.append(t)
            if len(batch) >= window:
                # Now and then a deadline too short to see them all end: they are waited for again.
                timeout = 0.0 if rng.random() < 0.05 else 30.0
                try:
                    await waiting_for_transfer_complete(batch, timeout=timeout)
                except TransferError as err:
                    errors += 1
                    ids = [e.transfer_id for e in err.exceptions]
                    listed_twice += len(ids) - len(set(ids))
                    if err.timed_out:
                        try:
                            await waiting_for_transfer_complete([t for t in batch if not t.done()], timeout=30)
                        except TransferError:
                            errors += 1
                batch = []
        try:
            await waiting_for_transfer_complete(batch, timeout=30)
        except TransferError:
            errors += 1
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        ok = sum(t.Succeeded() for t in started)
        failed = sum(t.Failed() for t in started)
        assert len(started) == n
        assert all(ended[t.id] == 1 for t in started), "a transfer ended twice, or never"
        assert ok + failed == n, f"{n - ok - failed} transfers neither succeeded nor failed"
        assert a.outstanding == 0, f"{a.outstanding} transfers still outstanding"
        assert listed_twice == 0, "an error listed a transfer twice"
        a.deregister_memory(local)  # raises MemoryInUse if a transfer kept its pin
        return {"n": n, "ok": ok, "failed": failed, "errors": errors, "wall": wall, "cpu": cpu}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transfers", type=int, default=200_000)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--fail-every", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--loops", default="asyncio,uvloop")
    args = ap.parse_args(argv)
    runs = {"asyncio": asyncio.run, "uvloop": uvloop.run}
    for name in args.loops.split(","):
        r = runs[name](soak(args.transfers, args.window, args.fail_every, args.seed))
        print(
            f"{name:7}: {r['n']:,} transfers, each ended exactly once: {r['ok']:,} succeeded, {r['failed']:,} failed"
            f" ({r['errors']} TransferErrors); {r['n'] / r['wall'] / 1e3:.1f}k transfers/s,"
            f" {1e6 * r['cpu'] / r['n']:.1f} us CPU per transfer",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
