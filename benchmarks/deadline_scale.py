"""How late ``waiting_for_transfer_complete`` raises when many transfers are still in flight.

    python benchmarks/deadline_scale.py                     # 10,000 in flight, asyncio and uvloop
    python benchmarks/deadline_scale.py --transfers 1000 10000 --rounds 30

Two engines on the mock backend with a held NIC (nothing completes unless the
benchmark steps it), ``--transfers`` single-block reads posted, then
``waiting_for_transfer_complete(ts, timeout=T)``: every transfer times out.
Reports how long after the deadline the ``TransferError`` reached the caller
(loop time), p50 / p99 / max over the rounds, per loop. Each loop also runs the
same rounds with a bare ``loop.call_at`` timer and nothing in flight: how late
the loop itself wakes up on this machine, the floor under the first figure.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys

import numpy as np
import uvloop

from moriio_async import IOEngine, IOEngineConfig, MockOptions, TransferError, waiting_for_transfer_complete


async def rounds(n: int, count: int, timeout: float) -> list[float]:
    cfg = IOEngineConfig(backend="mock", sq_depth=1 << 16, mock=MockOptions(hold=True))
    late = []
    async with IOEngine("a", cfg) as a, IOEngine("b", cfg) as b:
        b.register_memory(np.zeros(1 << 16, dtype=np.uint8), name="m")
        local = a.register_memory(np.zeros(1 << 16, dtype=np.uint8))
        peer = await a.connect(b.address)
        session = await a.create_session(local, peer.memory["m"])
        ts = [session.read(i % 4096, i % 4096, 1) for i in range(n)]
        loop = asyncio.get_running_loop()
        for _ in range(count):
            # A fresh loop iteration: uvloop's loop.time() is the time the iteration began, so a round
            # started right after the last one's checks (below) would count those as lateness.
            await asyncio.sleep(0)
            start = loop.time()
            try:
                await waiting_for_transfer_complete(ts, timeout=timeout)
            except TransferError as err:
                late.append(loop.time() - start - timeout)
                if len(err.timed_out) != n:
                    raise AssertionError(f"{len(err.timed_out)} timed out, expected {n}") from None
            else:
                raise AssertionError("nothing should complete on a held NIC")
        await session.abort(timeout=5)
    return late


async def bare_timer(count: int, timeout: float) -> list[float]:
    """How late a plain ``call_at`` wakes its waiter, with nothing else on the loop."""
    loop = asyncio.get_running_loop()
    late = []
    for _ in range(count):
        fut: asyncio.Future[None] = loop.create_future()
        start = loop.time()
        loop.call_at(start + timeout, fut.set_result, None)
        await fut
        late.append(loop.time() - start - timeout)
    return late


def summary(late: list[float]) -> str:
    late = sorted(late)
    p99 = late[min(len(late) - 1, round(0.99 * (len(late) - 1)))]
    return (
        f"p50 {1e3 * statistics.median(late):6.2f} ms, p99 {1e3 * p99:6.2f} ms, max {1e3 * late[-1]:6.2f} ms"
        f" ({len(late)} rounds)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transfers", nargs="+", type=int, default=[10_000])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--timeout", type=float, default=0.2)
    args = ap.parse_args(argv)
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
    for n in args.transfers:
        for name, run in (("asyncio", asyncio.run), ("uvloop", uvloop.run)):
            late = run(rounds(n, args.rounds, args.timeout))
            print(f"{n:6} in flight, {name:7}: raised after the deadline by {summary(late)}", flush=True)
            bare = run(bare_timer(args.rounds, args.timeout))
            print(f"{'bare timer':>16}, {name:7}: woke after the deadline by   {summary(bare)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
