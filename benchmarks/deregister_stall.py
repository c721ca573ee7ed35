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
import json
import socket
import statistics
import struct
import threading
import time
from typing import Any

import numpy as np

from moriio_async import IOEngine, IOEngineConfig


def frame(obj: dict[str, Any]) -> bytes:
    body = json.dumps(obj).encode()
    return struct.pack("!I", len(body)) + body


async def read_message(reader: asyncio.StreamReader) -> dict[str, Any]:
    (n,) = struct.unpack("!I", await reader.readexactly(4))
    message: dict[str, Any] = json.loads(await reader.readexactly(n))
    return message


async def one_round(engine: IOEngine, every: float) -> tuple[float, float, bool]:
    target = np.zeros(1 << 16, np.uint8)
    desc = engine.register_memory(target, name="victim")
    host, port = engine.address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(frame({"op": "hello", "id": 1, "engine": {"kind": "EngineDesc", "key": "hostile", "host": host,
                                                          "port": 1, "incarnation": 1, "backend": "tcp"}}))  # fmt: skip
    assert (await read_message(reader))["op"] == "welcome"
    endpoint = {"backend": "tcp", "accepting": False, "host": host, "port": 1, "qp_num": 7}
    writer.write(frame({"op": "connect_qp", "id": 2, "incarnation": engine.incarnation, "endpoint": endpoint}))
    answer = (await read_message(reader))["endpoint"]
    sock = socket.create_connection((host, int(answer["port"])))
    sock.sendall(struct.pack("<4sHH16sI", b"MRIO", 2, 0, bytes.fromhex(answer["token"]), 7))
    sock.recv(12)
    sock.sendall(struct.pack("<BBHIII", 0, 0, 0, 0, 1, 0) + struct.pack("<IIQQ", desc.rkey, 0, desc.addr, 4096))
    stop = threading.Event()

    def drip() -> None:
        while not stop.is_set():
            try:
                sock.send(b"\7")
            except OSError:
                return
            stop.wait(every)

    dripper = threading.Thread(target=drip)
    dripper.start()
    while not target[0]:  # the first byte landed: the region is pinned by the peer's receive  # noqa: ASYNC110
        await asyncio.sleep(0.005)
    gaps: list[float] = []

    async def ticker() -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticking = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    began = time.perf_counter()
    engine.deregister_memory(desc)
    took = time.perf_counter() - began
    snapshot = target.copy()
    await asyncio.sleep(0.05)
    ticking.cancel()
    await asyncio.sleep(2 * every + 0.1)
    landed_after = not np.array_equal(target, snapshot)
    stop.set()
    dripper.join()
    sock.close()
    writer.close()
    return took, max(gaps), landed_after


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
