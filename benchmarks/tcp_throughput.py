"""TCP backend throughput between two processes, beside a raw socket stream in the same run.

    python benchmarks/tcp_throughput.py                      # full grid
    python benchmarks/tcp_throughput.py --blocks 1M --depths 16 --json out.json
    python benchmarks/tcp_throughput.py --secret --blocks 1M --depths 16   # with and without a shared secret
    python benchmarks/tcp_throughput.py --blocks 64K --batch 128 --depths 2 --rounds 5   # KV-shaped batches
    python benchmarks/tcp_throughput.py --blocks 1M --depths 16 --mixed --total 2G   # also READs and WRITEs mixed

For each block size and each number of transfers in flight, the initiator
issues single-block ``read``s (then ``write``s) against a target process's
registered buffer, keeping that many outstanding, and reports GB/s (with
``--mixed``, also READs and WRITEs alternating on the same pair: both
directions of its one connection busy at once, all bytes counted, its ratio
against the same one-way raw stream); with ``--batch N`` each
transfer is a ``batch_read``/``batch_write`` of N shuffled blocks that do
not merge (the shape of a KV-cache transfer). The raw
baseline moves the same bytes with ``sendall``/``recv_into`` between two
processes over loopback with the same block size: the ceiling a TCP-carried
one-sided transfer can reach on this machine. Both run in one invocation so
their ratio is meaningful; absolute figures depend on the machine. Each
measurement moves ``--total`` bytes (256M by default): at 1 MiB blocks that is
about 50 ms here, and the same cell then moves by 0.1-0.2 from one run to the
next; give ``--total 2G`` or more when a ratio is to be judged to 10%.

The raw stream cycles through as much memory on each end as the transfers
touch (the region for single-block transfers, the batch's blocks with
``--batch``): a stream that sends one block-sized buffer over and over keeps
both ends in the CPU's cache, and at 1 MiB that measured 1.3-1.7x faster here
than streaming 16-256 MiB of distinct memory. That one-buffer stream is still
measured and printed beside it ("hot"), with the ratios against both.

Each row also gives the CPU time per block of both ends ("cpu us/block"): the raw
stream's sender and receiver, and moriio_async's initiator (this process, every
thread) and target (the target process's threads, from ``/proc/PID/task/*/schedstat``,
nanoseconds), user and system time together, medians over the rounds. On loopback the
sending end also pays most of the TCP work, so the raw stream is sender-bound.

``--secret`` measures the same grid twice per round, once with engines that
share a secret (``IOEngineConfig.secret``: the hello is authenticated) and
once without (``secret=""``), alternating for ``--rounds`` rounds, and reports
the median of each (with the range over the rounds) and the median of the
per-round ratios (each round's two runs are back to back, so slow changes in
the machine's load cancel). The raw baseline is skipped there.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing as mp
import os
import secrets
import socket
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from moriio_async import IOEngine, IOEngineConfig, Session, Transfer

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    return int(text[:-1]) * UNITS[text[-1].upper()] if text[-1].upper() in UNITS else int(text)


# -- CPU time of a whole process -----------------------------------------------------------------


def process_cpu(pid: int) -> float:
    """Seconds of CPU (user and system) the live threads of process ``pid`` have used, to the
    nanosecond (``/proc/PID/task/*/schedstat``; the clock-tick counters of ``/proc/PID/stat`` are
    10 ms coarse, too coarse for one measurement). A thread that already ended is not counted."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended between the listing and the read
    return total / 1e9


# -- raw socket baseline -------------------------------------------------------------------------


def _raw_sink(port: int, total: int, block: int, footprint: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        buf = memoryview(bytearray(footprint))
        got = at = 0
        cpu = time.process_time()
        while got < total:
            n = s.recv_into(buf[at : at + block])
            if not n:
                break
            got += n
            at = (at + n) % footprint
        s.sendall(f"{time.process_time() - cpu:.9f}".encode())


def raw_stream(total: int, block: int, footprint: int | None = None) -> tuple[float, float, float]:
    """GB/s of one sendall/recv_into stream of ``total`` bytes in ``block``-sized sends, each end
    cycling through ``footprint`` bytes of its own memory (default: one block, sent over and over),
    and the sender's and the receiver's CPU seconds."""
    footprint = max(block, (footprint or block) // block * block)
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        proc = mp.get_context("spawn").Process(target=_raw_sink, args=(port, total, block, footprint))
        proc.start()
        conn, _ = server.accept()
        with conn:
            source = memoryview(os.urandom(footprint))
            start = time.perf_counter()
            cpu = time.process_time()  # this process's engine threads are idle meanwhile
            sent = at = 0
            while sent < total:
                conn.sendall(source[at : at + block])
                sent += block
                at = (at + block) % footprint
            sender_cpu = time.process_time() - cpu
            receiver_cpu = float(conn.recv(64))
            elapsed = time.perf_counter() - start
        proc.join()
    return total / elapsed / 1e9, sender_cpu, receiver_cpu


def touched(region: int, block: int, batch: int, total: int) -> int:
    """Bytes of memory each end of ``windowed`` cycles through: what the raw stream matches."""
    if batch > 1:
        return block * batch  # the same shuffled blocks, batch after batch
    return min(region // block * block, max(block, total // block * block))


# -- moriio_async ------------------------------------------------------------------------------


def _target(size: int, backend: str, pipe: Any, secret: str | None = None) -> None:
    async def main() -> None:
        buf = np.ones(size, dtype=np.uint8)
        async with IOEngine("bench-target", IOEngineConfig(backend=backend, secret=secret)) as engine:
            engine.register_memory(buf, name="kv")
            pipe.send(engine.address)
            await engine.recv_notification()

    asyncio.run(main())


async def windowed(session: Session, op: str, block: int, depth: int, total: int, region: int, batch: int = 1) -> float:
    """GB/s of ``total`` bytes moved in transfers of ``batch`` blocks, ``depth`` of them in flight
    (``op``: "read", "write", or "mixed": the two alternating).

    A batch's blocks are shuffled, with a block-sized gap after each, so that nothing merges:
    ``batch`` blocks are ``batch`` work requests, the shape of a KV-cache transfer."""
    window: collections.deque[Transfer] = collections.deque()
    slots = region // block
    batches = max(1, total // (block * batch))
    moved = total if batch == 1 else batches * block * batch
    start = time.perf_counter()
    if batch == 1:
        calls = _pick(op, session.read, session.write)
        for i in range(total // block):
            off = (i % slots) * block
            window.append(calls[i % 2](off, off, block))
            if len(window) >= depth:
                await window.popleft()
    else:
        many = _pick(op, session.batch_read, session.batch_write)
        if 2 * batch > slots:
            raise SystemExit(f"--batch {batch} of {block} B blocks with gaps needs more than the {region} B region")
        rng = np.random.default_rng(7)
        offsets = [int(o) * 2 * block for o in rng.permutation(batch)]
        others = [int(o) * 2 * block for o in rng.permutation(batch)]
        sizes = [block] * batch
        for i in range(batches):
            window.append(many[i % 2](offsets, others, sizes))
            if len(window) >= depth:
                await window.popleft()
    while window:
        await window.popleft()
    return moved / (time.perf_counter() - start) / 1e9


def _pick(op: str, read: Any, write: Any) -> tuple[Any, Any]:
    """The call for even and for odd transfers."""
    return (read, read) if op == "read" else (write, write) if op == "write" else (write, read)


def operations(args: argparse.Namespace) -> tuple[str, ...]:
    return ("read", "write", "mixed") if args.mixed else ("read", "write")


async def run_grid(args: argparse.Namespace) -> list[dict[str, Any]]:
    region = region_size(args)
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_target, args=(region, args.backend, child))
    proc.start()
    rows: list[dict[str, Any]] = []
    try:
        address = parent.recv()
        local = np.zeros(region, dtype=np.uint8)
        async with IOEngine("bench", IOEngineConfig(backend=args.backend, sq_depth=256)) as engine:
            desc = engine.register_memory(local, name="kv")
            peer = await engine.connect(address)
            session = await engine.create_session(desc, peer.memory["kv"])
            await windowed(session, "read", 1 << 20, 8, 64 << 20, region)  # warm-up
            for block in args.blocks:
                total = max(args.total, block * 16 * args.batch)
                for depth in args.depths:
                    # Raw, read and write take turns for --rounds rounds: each round's ratios come
                    # from the same minute, so the host's drifting load cancels in their median.
                    footprint = touched(region, block, args.batch, total)
                    raws: list[float] = []
                    hots: list[float] = []
                    got: dict[str, list[float]] = {op: [] for op in operations(args)}
                    cpu: dict[str, list[float]] = collections.defaultdict(list)  # us per block, per end
                    blocks = total // block
                    for _ in range(args.rounds):
                        gbps, sender, receiver = raw_stream(total, block, footprint)
                        raws.append(gbps)
                        cpu["raw_sender"].append(sender / blocks * 1e6)
                        cpu["raw_receiver"].append(receiver / blocks * 1e6)
                        hots.append(raw_stream(total, block)[0])
                        for op in operations(args):
                            mine, theirs = time.process_time(), process_cpu(proc.pid)
                            got[op].append(await windowed(session, op, block, depth, total, region, args.batch))
                            cpu[f"{op}_initiator"].append((time.process_time() - mine) / blocks * 1e6)
                            cpu[f"{op}_target"].append((process_cpu(proc.pid) - theirs) / blocks * 1e6)
                    row: dict[str, Any] = {"block": block, "batch": args.batch, "in_flight": depth,
                                           "raw_footprint": footprint, "raw_GBps": round(statistics.median(raws), 3),
                                           "raw_hot_GBps": round(statistics.median(hots), 3)}  # fmt: skip
                    row["cpu_us_per_block"] = {end: round(statistics.median(us), 1) for end, us in cpu.items()}
                    for op in operations(args):
                        row[f"{op}_GBps"] = round(statistics.median(got[op]), 3)
                        for key, base in (("raw", raws), ("raw_hot", hots)):
                            ratios = [g / r for g, r in zip(got[op], base, strict=True)]
                            row[f"{op}_vs_{key}"] = round(statistics.median(ratios), 3)
                    rows.append(row)
                    ops = "  ".join(
                        f"{op} {row[f'{op}_GBps']:5.2f} ({row[f'{op}_vs_raw']:.0%}, hot {row[f'{op}_vs_raw_hot']:.0%})"
                        for op in operations(args)
                    )
                    print(
                        f"{block >> 10:>6} KiB x {args.batch:<4} in flight {depth:>3}  "
                        f"raw {row['raw_GBps']:5.2f} (hot {row['raw_hot_GBps']:5.2f})  {ops}  GB/s"
                        + (f"  (medians of {args.rounds} rounds)" if args.rounds > 1 else ""),
                        flush=True,
                    )
                    us = row["cpu_us_per_block"]
                    print(
                        f"{'':>27}cpu us/block: raw send {us['raw_sender']:.0f} recv {us['raw_receiver']:.0f}  "
                        + "  ".join(
                            f"{op} initiator {us[f'{op}_initiator']:.0f} target {us[f'{op}_target']:.0f}"
                            for op in operations(args)
                        ),
                        flush=True,
                    )
            await engine.notify("bench-target", b"done")
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return rows


def region_size(args: argparse.Namespace) -> int:
    region = max(args.blocks) * max(max(args.depths), 2 * args.batch)
    return int(min(max(region, 64 << 20), 1 << 30))


async def measure_once(args: argparse.Namespace, secret: str) -> dict[tuple[int, int, str], float]:
    """GB/s for every (block, depth, op) between two fresh processes whose engines use ``secret`` ("" = none)."""
    region = region_size(args)
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_target, args=(region, args.backend, child, secret))
    proc.start()
    out: dict[tuple[int, int, str], float] = {}
    try:
        address = parent.recv()
        local = np.zeros(region, dtype=np.uint8)
        config = IOEngineConfig(backend=args.backend, sq_depth=256, secret=secret)
        async with IOEngine("bench", config) as engine:
            assert engine.statistics().authenticated == bool(secret)
            desc = engine.register_memory(local, name="kv")
            peer = await engine.connect(address)  # the hello: authenticated when there is a secret
            hellos = []
            for _ in range(HELLOS):  # what the secret costs: one more round trip and two HMACs per hello
                start = time.perf_counter()
                await engine.connect(address)
                hellos.append(time.perf_counter() - start)
            out[(0, 0, "hello_ms")] = statistics.median(hellos) * 1e3
            session = await engine.create_session(desc, peer.memory["kv"])
            await windowed(session, "read", 1 << 20, 8, 64 << 20, region)  # warm-up
            for block in args.blocks:
                total = max(args.total, block * 16 * args.batch)
                for depth in args.depths:
                    for op in operations(args):
                        out[(block, depth, op)] = await windowed(session, op, block, depth, total, region, args.batch)
            await engine.notify("bench-target", b"done")
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return out


HELLOS = 20
"""Hellos timed per run with ``--secret`` (each opens a link of its own)."""


async def compare_secret(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Alternate runs without and with a shared secret; the median of each, and their ratio."""
    secret = secrets.token_urlsafe(32)
    runs: dict[str, list[dict[tuple[int, int, str], float]]] = {"none": [], "secret": []}
    for r in range(args.rounds):
        for mode in ("none", "secret"):
            runs[mode].append(await measure_once(args, secret if mode == "secret" else ""))
            print(f"round {r + 1}/{args.rounds}: {mode} done", flush=True)
    rows: list[dict[str, Any]] = []
    for key in runs["none"][0]:
        block, depth, op = key
        plains = [run[key] for run in runs["none"]]
        autheds = [run[key] for run in runs["secret"]]
        plain, authed = statistics.median(plains), statistics.median(autheds)
        # Each round's two runs are back to back: the median of their ratios cancels slow drift in load.
        ratio = statistics.median(a / n for a, n in zip(autheds, plains, strict=True))
        rows.append({"block": block, "in_flight": depth, "op": op, "no_secret_GBps": round(plain, 3),
                     "secret_GBps": round(authed, 3), "ratio": round(ratio, 3),
                     "no_secret_runs": [round(x, 3) for x in plains],
                     "secret_runs": [round(x, 3) for x in autheds]})  # fmt: skip
        if op == "hello_ms":
            print(f"hello (connect) median ms: no secret {plain:.2f}  secret {authed:.2f}", flush=True)
            continue
        print(
            f"{block >> 10:>6} KiB  in flight {depth:>3}  {op:<5}  "
            f"no secret {plain:5.2f} [{min(plains):.2f}-{max(plains):.2f}]  "
            f"secret {authed:5.2f} [{min(autheds):.2f}-{max(autheds):.2f}] GB/s  "
            f"(secret/none, median of paired rounds: {ratio:.1%})",
            flush=True,
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", nargs="+", default=["64K", "256K", "1M", "4M", "16M"])
    parser.add_argument("--depths", nargs="+", type=int, default=[1, 4, 16, 64])
    parser.add_argument("--total", type=parse_size, default=parse_size("256M"), help="bytes per measurement")
    parser.add_argument("--backend", default="tcp")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--secret", action="store_true", help="compare engines with and without a shared secret")
    parser.add_argument("--rounds", type=int, default=None,
                        help="alternating rounds, median of each and of the per-round ratios (default 3 with "
                             "--secret, else 1)")  # fmt: skip
    parser.add_argument(
        "--mixed", action="store_true", help="also measure READs and WRITEs alternating on the same pair"
    )
    parser.add_argument("--batch", type=int, default=1,
                        help="blocks per transfer (batch_read/batch_write of shuffled blocks that do not merge; "
                             "default 1: single-block read/write)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 3 if args.secret else 1
    args.blocks = [parse_size(b) for b in args.blocks]
    if args.secret:
        print(f"moriio_async {args.backend} backend, with and without a shared secret, python {sys.version.split()[0]}")
        rows = asyncio.run(compare_secret(args))
    else:
        print(f"moriio_async {args.backend} backend vs raw socket loopback, python {sys.version.split()[0]}")
        rows = asyncio.run(run_grid(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
