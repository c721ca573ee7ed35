"""How long the event loop stands still while ``deregister_memory`` runs under a hostile peer's trickled WRITE.

    python benchmarks/deregister_stall.py               # 5 rounds, a byte every 0.5 s
    python benchmarks/deregister_stall.py --rounds 20 --every 0.1

A hand-written peer (no secret) says hello to a TCP engine, has it answer a
queue pair, dials the data port and starts a 4 KiB WRITE into an exported
region whose payload it sends one byte every ``--every`` seconds. Once the
first byte landed, the engine deregisters the region on its loop while a
ticker task (2 ms sleeps) records the loop's gaps. Printed per round: how
long ``deregister_memory`` took, the loop's longest gap around it, and whether
any byte landed after it returned. Issue 8 measured 18.5 s here before
deregistration aborted the peer's receive.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' hand-written wire clients

from moriio_async import IOEngine, IOEngineConfig
from tests.backends import datawire as dw
from tests.control.wire import hello, read_message


async def one_round(engine: IOEngine, every: float) -> tuple[float, float, bool]:
    target = np.zeros(1 << 16, np.uint8)
    desc = engine.register_memory(target, name="victim")
    said = await hello(engine.address, "hostile", backend="tcp")
    assert said.welcomed, said.replies
    endpoint = {"backend": "tcp", "accepting": False, "host": "127.0.0.1", "port": 1, "qp_num": 7}
    await said.send({"op": "connect_qp", "id": 2, "incarnation": engine.incarnation, "endpoint": endpoint})
    answer = (await read_message(said.reader))["endpoint"]
    sock, status = await asyncio.to_thread(dw.dial, int(answer["port"]), bytes.fromhex(answer["token"]))
    assert status == dw.OK
    sock.sendall(dw.chunk(dw.WRITE, 0, (desc.rkey, desc.addr, 4096)))
    try:
        with dw.Dripper(sock, every):
            while not target[0]:  # the first byte landed: the region is pinned by the peer's receive  # noqa: ASYNC110
                await asyncio.sleep(0.005)
            async with dw.LoopGaps() as gaps:
                await asyncio.sleep(0.05)
                began = time.perf_counter()
                engine.deregister_memory(desc)
                took = time.perf_counter() - began
                snapshot = target.copy()
                await asyncio.sleep(0.05)
            await asyncio.sleep(2 * every + 0.1)
            landed_after = not np.array_equal(target, snapshot)
    finally:
        sock.close()
        await said.close()
    return took, gaps.longest, landed_after


async def main(args: argparse.Namespace) -> None:
    cfg = IOEngineConfig(backend="tcp", secret="", retry_timeout=30.0)
    async with IOEngine("target", cfg) as engine:
        rows = [await one_round(engine, args.every) for _ in range(args.rounds)]
    for i, (took, gap, landed) in enumerate(rows):
        print(f"round {i}: deregister_memory {took * 1000:.2f} ms, longest loop gap {gap * 1000:.1f} ms, "
              f"bytes after it returned: {'YES' if landed else 'none'}")  # fmt: skip
    print(f"median deregister {statistics.median(r[0] for r in rows) * 1000:.2f} ms, "
          f"worst loop gap {max(r[1] for r in rows) * 1000:.1f} ms over {args.rounds} rounds "
          f"(a byte every {args.every:g} s)")  # fmt: skip


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--every", type=float, default=0.5, help="seconds between the trickled bytes")
    asyncio.run(main(p.parse_args()))
