"""Disaggregated prefill/decode: KV cache moved between two processes the way vLLM's MoRIIO connector does.

    python examples/prefill_decode.py                  # WRITE mode (prefill pushes), TCP backend
    python examples/prefill_decode.py --mode read      # READ mode (decode pulls)
    python examples/prefill_decode.py --requests 200 --concurrency 16 --backend auto

The script starts a prefill server in a second process and runs the decode
side itself. Each side registers a paged KV cache (layers x blocks x
block bytes) and the two exchange small control messages as engine
notifications, with the names the MoRIIO connector uses:

* WRITE mode: decode allocates blocks and sends ``remote_blocks``; prefill
  "computes" the KV (a deterministic function of the prompt), writes it
  straight into decode's blocks with one ``batch_write`` per layer, and
  sends ``write_done`` (or ``write_failed``) once every layer completed.
* READ mode: decode sends ``prefill`` with the prompt; prefill computes the
  KV into its own blocks and answers ``kv_ready`` with their ids; decode
  pulls them with one ``batch_read`` per layer and sends ``release``.

Decode then checks every byte against the KV it expects for that prompt.
Progress goes to stderr each second; a summary (requests, GB/s, transfer
latency percentiles) ends the run; the exit status is 0 only if every
request's KV arrived intact.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from moriio_async import IOEngine, IOEngineConfig, Session, waiting_for_transfer_complete


class KVCache:
    """A paged KV cache: ``layers`` x ``blocks`` blocks of ``block_bytes`` each, and a free list."""

    def __init__(self, layers: int, blocks: int, block_bytes: int) -> None:
        self.layers, self.blocks, self.block_bytes = layers, blocks, block_bytes
        self.buf = np.zeros(layers * blocks * block_bytes, dtype=np.uint8)
        self.free = list(range(blocks))
        self.freed = asyncio.Event()

    def offset(self, layer: int, block: int) -> int:
        return (layer * self.blocks + block) * self.block_bytes

    async def allocate(self, n: int) -> list[int]:
        while len(self.free) < n:  # admission control: wait for a release
            self.freed.clear()
            await self.freed.wait()
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def release(self, ids: Sequence[int]) -> None:
        self.free.extend(ids)
        self.free.sort()
        self.freed.set()

    def view(self, layer: int, block: int) -> np.ndarray:
        start = self.offset(layer, block)
        return self.buf[start : start + self.block_bytes]


def expected_kv(prompt_seed: int, layer: int, index: int, block_bytes: int) -> np.ndarray:
    """What the model would compute for token block ``index`` of a prompt, at one layer."""
    # A cheap stand-in for attention: every block's bytes differ with prompt, layer and position.
    base = (prompt_seed * 1_000_003 + layer * 8191 + index * 131) & 0xFFFFFFFF
    words = np.arange(block_bytes // 4, dtype=np.uint32) * np.uint32(2654435761) + np.uint32(base)
    return words.view(np.uint8)


def compute_prefill(cache: KVCache, prompt_seed: int, ids: Sequence[int]) -> None:
    for layer in range(cache.layers):
        for index, block in enumerate(ids):
            cache.view(layer, block)[:] = expected_kv(prompt_seed, layer, index, cache.block_bytes)


async def send(engine: IOEngine, peer: str, **msg: Any) -> None:
    await engine.notify(peer, json.dumps(msg).encode())


def layer_blocks(
    cache: KVCache, local_ids: Sequence[int], remote_ids: Sequence[int], layer: int
) -> tuple[list[int], list[int], list[int]]:
    """Offsets of one layer's blocks on both sides (both caches share one layout)."""
    local = [cache.offset(layer, b) for b in local_ids]
    remote = [cache.offset(layer, b) for b in remote_ids]
    return local, remote, [cache.block_bytes] * len(local)


# -- prefill -----------------------------------------------------------------------------------


async def run_prefill(args: argparse.Namespace) -> int:
    cache = KVCache(args.layers, args.blocks, args.block_kib << 10)
    cfg = IOEngineConfig(backend=args.backend, transfer_timeout=args.timeout)
    async with IOEngine("prefill-0", cfg) as engine:
        region = engine.register_memory(cache.buf, name="kv")
        print(json.dumps({"address": engine.address, "backend": engine.backend_name}), flush=True)
        session: Session | None = None
        tasks: set[asyncio.Task[None]] = set()

        async def handle_remote_blocks(msg: dict[str, Any]) -> None:
            assert session is not None
            ids = await cache.allocate(len(msg["blocks"]))
            try:
                compute_prefill(cache, msg["seed"], ids)
                transfers = [
                    session.batch_write(*layer_blocks(cache, ids, msg["blocks"], layer))
                    for layer in range(cache.layers)
                ]
                await waiting_for_transfer_complete(transfers, timeout=args.timeout)
                await send(engine, "decode-0", type="write_done", req=msg["req"], num_writers=1)
            except Exception as exc:  # the consumer must hear about it rather than wait forever
                await send(engine, "decode-0", type="write_failed", req=msg["req"], error=str(exc))
            finally:
                cache.release(ids)

        async def handle_prefill(msg: dict[str, Any]) -> None:
            ids = await cache.allocate(msg["num_blocks"])
            compute_prefill(cache, msg["seed"], ids)
            await send(engine, "decode-0", type="kv_ready", req=msg["req"], blocks=ids)

        handlers = {"remote_blocks": handle_remote_blocks, "prefill": handle_prefill}
        async for note in engine.notifications():
            msg = json.loads(note.data)
            kind = msg["type"]
            if kind == "hello":  # decode's engine: open the WRITE-mode session towards it
                peer = await engine.connect(msg["address"])
                session = await engine.create_session(region, peer.memory["kv"])
                await send(engine, "decode-0", type="ready")
            elif kind == "release":
                cache.release(msg["blocks"])
            elif kind == "shutdown":
                break
            elif kind in handlers:
                task = asyncio.create_task(handlers[kind](msg))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
    return 0


# -- decode ------------------------------------------------------------------------------------


class Decode:
    def __init__(self, args: argparse.Namespace, engine: IOEngine, cache: KVCache, session: Session) -> None:
        self.args, self.engine, self.cache, self.session = args, engine, cache, session
        self.waiters: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.latencies: list[float] = []
        self.bytes = 0
        self.done = 0
        self.bad = 0

    async def route_notifications(self) -> None:
        async for note in self.engine.notifications():
            msg = json.loads(note.data)
            fut = self.waiters.pop(msg.get("req", -1), None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
            elif msg["type"] == "ready":
                self.waiters.pop(-1).set_result(msg)

    def expect(self, req: int) -> asyncio.Future[dict[str, Any]]:
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.waiters[req] = fut
        return fut

    async def request(self, req: int, seed: int, num_blocks: int) -> None:
        cache, args = self.cache, self.args
        ids = await cache.allocate(num_blocks)
        try:
            start = time.perf_counter()
            if args.mode == "write":
                reply = self.expect(req)
                await send(self.engine, "prefill-0", type="remote_blocks", req=req, seed=seed, blocks=ids)
                msg = await asyncio.wait_for(reply, args.timeout)
                if msg["type"] != "write_done":
                    raise RuntimeError(f"request {req}: prefill says {msg}")
            else:
                reply = self.expect(req)
                await send(self.engine, "prefill-0", type="prefill", req=req, seed=seed, num_blocks=num_blocks)
                msg = await asyncio.wait_for(reply, args.timeout)
                transfers = [
                    self.session.batch_read(*layer_blocks(cache, ids, msg["blocks"], layer))
                    for layer in range(cache.layers)
                ]
                try:
                    await waiting_for_transfer_complete(transfers, timeout=args.timeout)
                finally:
                    await send(self.engine, "prefill-0", type="release", blocks=msg["blocks"])
            self.latencies.append(time.perf_counter() - start)
            intact = all(
                np.array_equal(cache.view(layer, block), expected_kv(seed, layer, index, cache.block_bytes))
                for layer in range(cache.layers)
                for index, block in enumerate(ids)
            )
            self.bad += not intact
            self.bytes += num_blocks * cache.layers * cache.block_bytes
            self.done += 1
        finally:
            cache.release(ids)


async def run_decode(args: argparse.Namespace) -> int:
    shared = ["--backend", args.backend, "--layers", str(args.layers), "--blocks", str(args.blocks)]
    shared += ["--block-kib", str(args.block_kib), "--timeout", str(args.timeout)]
    prefill = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--role", "prefill", *shared, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert prefill.stdout is not None
        hello = json.loads(await prefill.stdout.readline())
        cache = KVCache(args.layers, args.blocks, args.block_kib << 10)
        cfg = IOEngineConfig(backend=args.backend, transfer_timeout=args.timeout)
        async with IOEngine("decode-0", cfg) as engine:
            region = engine.register_memory(cache.buf, name="kv")
            peer = await engine.connect(hello["address"])
            session = await engine.create_session(region, peer.memory["kv"])
            decode = Decode(args, engine, cache, session)
            router = asyncio.create_task(decode.route_notifications())
            ready = decode.expect(-1)
            await send(engine, "prefill-0", type="hello", address=engine.address)
            await asyncio.wait_for(ready, args.timeout)
            print(
                f"{args.mode.upper()} mode, backend {hello['backend']}: {args.requests} requests, "
                f"{args.layers} layers x {args.block_kib} KiB blocks, concurrency {args.concurrency}",
                file=sys.stderr,
            )
            rng = np.random.default_rng(args.seed)
            limit = asyncio.Semaphore(args.concurrency)
            start = time.perf_counter()

            async def one(req: int) -> None:
                async with limit:
                    await decode.request(
                        req, int(rng.integers(1 << 31)), int(rng.integers(1, args.max_prompt_blocks + 1))
                    )

            async def progress() -> None:
                while True:
                    await asyncio.sleep(1)
                    print(f"  {decode.done}/{args.requests} requests, {decode.bytes >> 20} MiB", file=sys.stderr)

            ticker = asyncio.create_task(progress())
            await asyncio.gather(*(one(r) for r in range(args.requests)))
            elapsed = time.perf_counter() - start
            ticker.cancel()
            await send(engine, "prefill-0", type="shutdown")
            router.cancel()
        lat = sorted(decode.latencies)
        p50 = statistics.median(lat) * 1e3
        p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3
        print(
            f"{decode.done} requests in {elapsed:.2f}s: {decode.bytes / elapsed / 1e9:.2f} GB/s of KV, "
            f"request latency (prefill + transfer) p50 {p50:.1f} ms p99 {p99:.1f} ms, {decode.bad} corrupted",
            file=sys.stderr,
        )
        ok = decode.bad == 0 and decode.done == args.requests and await asyncio.wait_for(prefill.wait(), 30) == 0
        print("OK: every request's KV cache arrived intact" if ok else "FAIL", file=sys.stderr)
        return 0 if ok else 1
    finally:
        if prefill.returncode is None:
            prefill.kill()
            await prefill.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=["decode", "prefill"], default="decode")
    parser.add_argument("--mode", choices=["write", "read"], default="write", help="vLLM's read_mode")
    parser.add_argument("--backend", default="tcp", help="tcp, verbs or auto")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=256, help="KV blocks per layer on each side")
    parser.add_argument("--block-kib", type=int, default=64, help="a multiple of 4")
    parser.add_argument("--max-prompt-blocks", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=30.0, help="vLLM's transfer_timeout")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    runner = run_prefill if args.role == "prefill" else run_decode
    try:
        import uvloop
    except ImportError:
        return asyncio.run(runner(args))
    return uvloop.run(runner(args))


if __name__ == "__main__":
    sys.exit(main())
