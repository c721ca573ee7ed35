"""Two processes, one transfer job: the initiator reads a remote buffer in blocks and writes it back.

    python examples/transfer.py                # 256 MiB in 1 MiB blocks over the TCP backend
    python examples/transfer.py --size-mib 64 --block-kib 256 --backend auto

The script starts the target itself (a second Python process that registers
a buffer and serves one-sided reads and writes from its engine's NIC thread
while its own event loop just waits), then, as the initiator:

1. connects to the target's engine and learns its exported region "kv";
2. ``batch_read``s the whole region into a local buffer, in batches of
   ``--batch`` blocks, with up to ``--in-flight`` batches outstanding;
3. checks the bytes against the pattern the target wrote;
4. transforms them and ``batch_write``s them back;
5. notifies the target, which verifies every byte on its side and reports.

Progress goes to stderr every second; the exit status is 0 only when both
sides saw byte-identical data.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence

import numpy as np

from moriio_async import IOEngine, IOEngineConfig, Session, Transfer, waiting_for_transfer_complete

PATTERN_SEED = 20261130


def pattern(size: int) -> np.ndarray:
    return np.random.default_rng(PATTERN_SEED).integers(0, 256, size, dtype=np.uint8)


async def run_target(args: argparse.Namespace) -> int:
    size = args.size_mib << 20
    buf = pattern(size)
    async with IOEngine("target", IOEngineConfig(backend=args.backend)) as engine:
        engine.register_memory(buf, name="kv")
        print(json.dumps({"address": engine.address, "backend": engine.backend_name}), flush=True)
        note = await engine.recv_notification()
        expected = pattern(size) ^ 0x5A
        ok = bool(np.array_equal(buf, expected))
        print(json.dumps({"verified": ok, "notification": note.data.decode()}), flush=True)
        return 0 if ok else 1


async def pipeline(
    sessions: Sequence[Session], op: str, size: int, block: int, batch: int, in_flight: int, label: str
) -> float:
    """Move the whole region in batches, keeping up to ``in_flight`` batches outstanding."""
    offsets = list(range(0, size, block))
    chunks = [offsets[i : i + batch] for i in range(0, len(offsets), batch)]
    pending: list[Transfer] = []
    done_bytes = 0
    start = last = time.perf_counter()
    for i, chunk in enumerate(chunks):
        session = sessions[i % len(sessions)]
        call = session.batch_read if op == "read" else session.batch_write
        pending.append(call(chunk, chunk, [block] * len(chunk)))
        if len(pending) >= in_flight:
            head = pending.pop(0)
            await waiting_for_transfer_complete([head], timeout=60)
            done_bytes += head.nbytes
        now = time.perf_counter()
        if now - last >= 1.0:
            print(f"  {label}: {done_bytes >> 20} / {size >> 20} MiB", file=sys.stderr)
            last = now
    await waiting_for_transfer_complete(pending, timeout=60)
    elapsed = time.perf_counter() - start
    print(f"  {label}: {size >> 20} MiB in {elapsed:.3f}s = {size / elapsed / 1e9:.2f} GB/s", file=sys.stderr)
    return elapsed


async def run_initiator(args: argparse.Namespace) -> int:
    size, block = args.size_mib << 20, args.block_kib << 10
    if size % block:
        print("size must be a multiple of the block size", file=sys.stderr)
        return 2
    target = await asyncio.create_subprocess_exec(
        *[sys.executable, __file__, "--role", "target", "--size-mib", str(args.size_mib), "--backend", args.backend],
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert target.stdout is not None
        hello = json.loads(await target.stdout.readline())
        print(f"target at {hello['address']} (backend {hello['backend']})", file=sys.stderr)
        local = np.zeros(size, dtype=np.uint8)
        async with IOEngine("initiator", IOEngineConfig(backend=args.backend)) as engine:
            desc = engine.register_memory(local, name="kv")
            peer = await engine.connect(hello["address"])
            sessions = [await engine.create_session(desc, peer.memory["kv"]) for _ in range(args.sessions)]
            await pipeline(sessions, "read", size, block, args.batch, args.in_flight, "batch_read")
            if not np.array_equal(local, pattern(size)):
                print("FAIL: data read differs from the target's pattern", file=sys.stderr)
                return 1
            np.bitwise_xor(local, 0x5A, out=local)
            await pipeline(sessions, "write", size, block, args.batch, args.in_flight, "batch_write")
            await engine.notify("target", b"write_done")
        result = json.loads(await target.stdout.readline())
        ok = bool(result["verified"]) and await asyncio.wait_for(target.wait(), 30) == 0
        print("OK: byte-identical both ways" if ok else "FAIL: target saw different bytes", file=sys.stderr)
        return 0 if ok else 1
    finally:
        if target.returncode is None:
            target.kill()
            await target.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=["initiator", "target"], default="initiator")
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--block-kib", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8, help="blocks per batch_read/batch_write")
    parser.add_argument("--in-flight", type=int, default=8, help="batches outstanding at once")
    parser.add_argument("--sessions", type=int, default=1, help="sessions (queue pairs) to spread batches over")
    parser.add_argument("--backend", default="tcp", help="tcp, verbs or auto")
    args = parser.parse_args(argv)
    runner = run_target if args.role == "target" else run_initiator
    try:
        import uvloop

        return uvloop.run(runner(args))
    except ImportError:
        return asyncio.run(runner(args))


if __name__ == "__main__":
    sys.exit(main())
