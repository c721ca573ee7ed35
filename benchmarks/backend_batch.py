"""A backend driven directly (no engine, no event loop): CPU per work request and throughput, beside
a raw socket stream in the same run.

    python benchmarks/backend_batch.py                          # tcp: 4K/64K/1M blocks, batches 1/64/1024
    python benchmarks/backend_batch.py --backend mock --sizes 4K --batches 1024
    python benchmarks/backend_batch.py --json out.json

Both ends live in this process (two backends joined by a queue pair over
loopback), so ``time.process_time`` covers the initiator's and the target's
NIC threads and the kernel's copies alike. Each batch is ``n`` blocks at
non-contiguous, shuffled offsets on both sides, posted with one ``post``
(only the last request signaled, as the runtime posts), with up to
``--in-flight`` requests outstanding. ``cpu/WR`` is CPU time per work request;
the raw column is one ``sendall``/``recv_into`` stream between two threads of
this process, in blocks of the same size: its CPU per block is what the bytes
alone cost, so ``cpu/WR - raw cpu/block`` is the backend's own cost.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import select
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from moriio_async.backends import open_backend
from moriio_async.backends.base import BackendOptions, CompletionQueue, QueuePair
from moriio_async.status import Access, Opcode
from moriio_async.work import WorkBatch

UNITS = {"K": 1 << 10, "M": 1 << 20}
REGION = 256 << 20


def parse_size(text: str) -> int:
    return int(text[:-1]) * UNITS[text[-1].upper()] if text[-1].upper() in UNITS else int(text)


def raw_stream(total: int, block: int) -> tuple[float, float]:
    """GB/s and CPU seconds per block of one loopback stream between two threads of this process."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        conn, _ = server.accept()

        def sink() -> None:
            buf = memoryview(bytearray(max(block, 1 << 16)))
            got = 0
            while got < total:
                n = conn.recv_into(buf)
                if not n:
                    return
                got += n

        payload = memoryview(bytearray(block))
        t = threading.Thread(target=sink)
        cpu, wall = time.process_time(), time.perf_counter()
        t.start()
        for _ in range(total // block):
            client.sendall(payload)
        t.join()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        client.close()
        conn.close()
    return total / wall / 1e9, cpu / (total // block)


def make_batch(n: int, size: int, op: Opcode, rng: np.random.Generator, local: Any, remote: Any) -> WorkBatch:
    """``n`` requests of one block each, at shuffled non-adjacent offsets (a gap after every block)."""
    slots = REGION // (2 * size)
    loc = (rng.permutation(slots)[: min(n, slots)] * 2 * size).astype(np.uint64)
    rem = (rng.permutation(slots)[: min(n, slots)] * 2 * size).astype(np.uint64)
    loc, rem = np.resize(loc, n), np.resize(rem, n)  # more blocks than slots: offsets repeat
    signaled = np.zeros(n, dtype=np.bool_)
    signaled[-1] = True
    return WorkBatch(
        0,
        np.full(n, int(op), dtype=np.uint8),
        rem + np.uint64(remote.addr),
        np.full(n, remote.rkey, dtype=np.uint32),
        np.full(n, size, dtype=np.uint64),
        signaled,
        np.arange(n + 1, dtype=np.int64),
        loc + np.uint64(local.addr),
        np.full(n, size, dtype=np.uint64),
        np.full(n, local.lkey, dtype=np.uint32),
    )


def wait_some(cq: CompletionQueue) -> int:
    """Take at least one completion (each must succeed), sleeping on the channel fd between polls."""
    fd = cq.fileno()
    while True:
        wcs = cq.poll(256)
        if wcs:
            for wc in wcs:
                if not wc.ok:
                    raise RuntimeError(f"a request failed: {wc}")
            return len(wcs)
        select.select([fd], [], [], 5.0)
        cq.get_event()
        cq.req_notify()


def run_one(qp: QueuePair, cq: CompletionQueue, batch: WorkBatch, in_flight: int, min_bytes: int) -> dict[str, float]:
    n = len(batch)
    size = int(batch.length[0])
    batches = max(3, -(-min_bytes // (n * size)))
    depth = max(1, in_flight // n)  # batches outstanding at once
    cq.req_notify()
    cpu, wall = time.process_time(), time.perf_counter()
    posted = done = 0
    next_id = 0
    while done < batches:
        while posted < batches and posted - done < depth:
            qp.post(dataclasses.replace(batch, wr_id=next_id))
            next_id += n
            posted += 1
        done += wait_some(cq)  # one signaled request per batch
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    wrs = batches * n
    return {"GBps": wrs * size / wall / 1e9, "cpu_us_per_wr": cpu / wrs * 1e6, "wrs": wrs}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="tcp")
    parser.add_argument("--sizes", nargs="+", default=["4K", "64K", "1M"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 64, 1024])
    parser.add_argument("--ops", nargs="+", default=["write", "read"], choices=["write", "read"])
    parser.add_argument("--in-flight", type=int, default=64, help="requests outstanding when batches are small")
    parser.add_argument("--min-bytes", type=parse_size, default=parse_size("64M"), help="bytes per measurement")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    opts = BackendOptions(sq_depth=4096, max_sge=16, retry_timeout=10.0)
    a, b = open_backend(args.backend, opts), open_backend(args.backend, opts)
    cq = a.create_cq(8192)
    qa, qb = a.create_qp(cq), b.create_qp(b.create_cq(64))
    qb.connect(json.loads(json.dumps(dict(qa.endpoint()))))
    qa.connect(json.loads(json.dumps(dict(qb.endpoint()))))
    local, remote = np.ones(REGION, np.uint8), np.full(REGION, 2, np.uint8)  # touched: no page faults timed
    mr_a, mr_b = a.register_memory(memoryview(local), Access.all()), b.register_memory(memoryview(remote), Access.all())
    b.export_memory(mr_b)
    rng = np.random.default_rng(1)
    print(f"{args.backend} backend driven directly, both ends in one process; python {sys.version.split()[0]}")
    print(f"{'size':>6} {'batch':>5} {'op':>5} {'GB/s':>7} {'raw GB/s':>8} {'ratio':>6} {'cpu/WR us':>9} "
          f"{'raw cpu/blk us':>14}")  # fmt: skip
    rows: list[dict[str, Any]] = []
    try:
        for size in map(parse_size, args.sizes):
            raw_gbps, raw_cpu = raw_stream(max(args.min_bytes, 64 * size), size) if args.backend != "mock" else (0, 0)
            for n in args.batches:
                for op in args.ops:
                    opcode = Opcode.RDMA_WRITE if op == "write" else Opcode.RDMA_READ
                    batch = make_batch(n, size, opcode, rng, mr_a, mr_b)
                    run_one(qa, cq, batch, args.in_flight, 0)  # warm-up: three batches
                    r = run_one(qa, cq, batch, args.in_flight, args.min_bytes)
                    ratio = r["GBps"] / raw_gbps if raw_gbps else 0.0
                    rows.append({"size": size, "batch": n, "op": op, **r, "raw_GBps": raw_gbps,
                                 "raw_cpu_us_per_block": raw_cpu * 1e6, "ratio": ratio})  # fmt: skip
                    print(f"{size >> 10:>5}K {n:>5} {op:>5} {r['GBps']:>7.2f} {raw_gbps:>8.2f} {ratio:>6.2f} "
                          f"{r['cpu_us_per_wr']:>9.2f} {raw_cpu * 1e6:>14.2f}", flush=True)  # fmt: skip
    finally:
        qa.close()
        qb.close()
        a.close()
        b.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
