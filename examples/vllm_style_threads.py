"""vLLM-style KV-cache reads from worker threads, through the MoRIIO wrapper surface.

Two processes on this machine. The prefill process registers one KV-cache
buffer per layer (every block filled with a pattern derived from its layer
and block id) and hands out its packed engine and memory descriptors. The
decode process builds one session per layer with ``MoRIIOWrapper`` and runs
``--workers`` threads that each take requests from a queue, issue one
``read_remote_data`` per layer on merged contiguous blocks, wait with
``waiting_for_transfer_complete(statuses)`` and check every byte. Some
requests leave their statuses to the final ``waiting_for_transfer_complete()``
with no list, which waits for the wrapper's transfers nobody has waited for.

    python examples/vllm_style_threads.py --workers 8 --requests 200

The code is written the way vLLM's MoRIIO connector drives MoRI-IO: only
the imports name moriio_async.
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import subprocess
import sys
import threading
import time

import numpy as np

from moriio_async.compat.mori import BackendType, IOEngine, IOEngineConfig, TransferStatus
from moriio_async.compat.vllm import MoRIIOConfig, MoRIIOWrapper, merge_contiguous_blocks


def pattern(layer: int, block: int, block_bytes: int) -> np.ndarray:
    return (np.arange(block_bytes, dtype=np.uint32) * 31 + layer * 1009 + block * 7919).astype(np.uint8)


def prefill(args: argparse.Namespace) -> None:
    engine = IOEngine("prefill-0", IOEngineConfig("127.0.0.1", 0))
    wrapper = MoRIIOWrapper(engine, tp_rank=0, dp_rank=0)
    wrapper.set_backend_type(BackendType.RDMA, qp_per_transfer=args.qp)
    block_bytes = args.block_kib << 10
    layers = []
    for layer in range(args.layers):
        kv = np.empty((args.blocks, block_bytes), dtype=np.uint8)
        for block in range(args.blocks):
            kv[block] = pattern(layer, block, block_bytes)
        layers.append(kv)
    packed = [wrapper.register_local_tensor(kv).hex() for kv in layers]
    print(json.dumps({"engine": wrapper.get_agent_metadata().hex(), "layers": packed}), flush=True)
    sys.stdin.readline()  # the decode side says when it is done
    engine.close()


def decode(args: argparse.Namespace) -> int:
    config = MoRIIOConfig.from_extra_config({"read_mode": "true", "qp_per_transfer": args.qp, "transfer_timeout": 30})
    child = subprocess.Popen(
        [sys.executable, __file__, "--role", "prefill", *sys.argv[1:]],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None
    assert child.stdout is not None
    hello = json.loads(child.stdout.readline())
    engine = IOEngine("decode-0", IOEngineConfig("127.0.0.1", 0))
    wrapper = MoRIIOWrapper(engine, tp_rank=config.tp_rank, dp_rank=config.dp_rank,
                            transfer_timeout=config.transfer_timeout)  # fmt: skip
    wrapper.set_backend_type(BackendType.RDMA, config.qp_per_transfer, config.post_batch_size, config.num_workers)
    wrapper.register_remote_engine(bytes.fromhex(hello["engine"]))
    block_bytes = args.block_kib << 10
    per_request = args.blocks_per_request
    local = [np.zeros((args.requests * per_request, block_bytes), dtype=np.uint8) for _ in range(args.layers)]
    local_descs = [wrapper.get_unpack_memory_metadata(wrapper.register_local_tensor(kv)) for kv in local]
    for layer, remote_hex in enumerate(hello["layers"]):
        remote = wrapper.get_unpack_memory_metadata(bytes.fromhex(remote_hex))
        wrapper.sessions.append(wrapper.build_session(local_descs[layer], remote))

    # Each request owns its local blocks (vLLM's block allocator), so workers never write the same bytes.
    # Half the requests read contiguous remote blocks (merged into one request), half scattered ones.
    rng = random.Random(7)
    requests: queue.Queue[tuple[int, list[int], list[int]] | None] = queue.Queue()
    for rid in range(args.requests):
        local_ids = list(range(rid * per_request, (rid + 1) * per_request))
        if rid % 2:
            first = rng.randrange(args.blocks - per_request + 1)
            remote_ids = list(range(first, first + per_request))
        else:
            remote_ids = rng.sample(range(args.blocks), per_request)
        requests.put((rid, local_ids, remote_ids))
    lock = threading.Lock()
    counts = {"requests": 0, "transfers": 0, "corrupted": 0, "errors": 0, "deferred": 0}
    deferred: list[tuple[list[int], list[int]]] = []

    def check(local_ids: list[int], remote_ids: list[int]) -> int:
        bad = 0
        for layer in range(args.layers):
            for lb, rb in zip(local_ids, remote_ids, strict=True):
                bad += not np.array_equal(local[layer][lb], pattern(layer, rb, block_bytes))
        return bad

    def worker() -> None:
        while (item := requests.get()) is not None:
            rid, local_ids, remote_ids = item
            statuses: list[TransferStatus] = []
            local_offsets = [b * block_bytes for b in local_ids]
            remote_offsets = [b * block_bytes for b in remote_ids]
            lo, ro, sz = merge_contiguous_blocks(local_offsets, remote_offsets, [block_bytes] * len(local_ids))
            for layer in range(args.layers):
                statuses.append(wrapper.read_remote_data(sz, lo, ro, wrapper.sessions[layer]))
            with lock:
                counts["transfers"] += len(statuses)
            if rid % 5 == 0:  # leave these to the final waiting_for_transfer_complete()
                with lock:
                    counts["deferred"] += 1
                    deferred.append((local_ids, remote_ids))
                continue
            try:
                wrapper.waiting_for_transfer_complete(statuses)
            except Exception as exc:
                print(f"request {rid}: {exc}", file=sys.stderr)
                with lock:
                    counts["errors"] += 1
                continue
            bad = check(local_ids, remote_ids)
            with lock:
                counts["requests"] += 1
                counts["corrupted"] += bad

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, name=f"worker-{i}") for i in range(args.workers)]
    for t in threads:
        t.start()
    for _ in threads:
        requests.put(None)
    for t in threads:
        t.join()
    pending = len(wrapper.transfer_status)
    wrapper.waiting_for_transfer_complete()  # the wrapper's own transfers that no one waited for
    for local_ids, remote_ids in deferred:
        counts["corrupted"] += check(local_ids, remote_ids)
        counts["requests"] += 1
    elapsed = time.perf_counter() - start
    left = len(wrapper.transfer_status)
    child.stdin.write("done\n")
    child.stdin.flush()
    child.wait(30)
    engine.close()
    print(
        f"{counts['requests']}/{args.requests} requests in {elapsed:.2f}s from {args.workers} threads: "
        f"{counts['transfers']} transfers ({pending} left to the final wait, {left} after it), "
        f"{counts['errors']} errors, {counts['corrupted']} corrupted"
    )
    ok = counts["requests"] == args.requests and not counts["errors"] and not counts["corrupted"]
    ok = ok and pending == counts["deferred"] * args.layers and left == 0
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=["decode", "prefill"], default="decode")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--blocks-per-request", type=int, default=8)
    parser.add_argument("--block-kib", type=int, default=4)
    parser.add_argument("--qp", type=int, default=2, help="qp_per_transfer")
    args = parser.parse_args()
    if args.role == "prefill":
        prefill(args)
        return 0
    return decode(args)


if __name__ == "__main__":
    sys.exit(main())
