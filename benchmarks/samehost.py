"""Same-host transfers side by side in one run: memcpy, raw cross-memory attach, moriio_async over cma
(user buffers, shared-memory buffers, windows split over threads) and over tcp, and Mooncake's tcp.

    python benchmarks/samehost.py                      # 64 KiB x 128, 1 MiB x 16, 16 MiB x 4; read and write
    python benchmarks/samehost.py --rounds 5 --json out.json --plot benchmarks/samehost.png
    python benchmarks/samehost.py --cases 64K:128 --systems "raw pvm" cma --no-mooncake --plot ''

Two real processes per system: a target registers a 256 MiB buffer (and, for cma,
a 256 MiB shared-memory buffer from ``allocate_memory``); the initiator (this
process) moves batches of non-contiguous blocks (shuffled offsets, a gap after
every block), one batch in flight (``--depth`` for more, moriio_async columns
only), as ``vs_mooncake.py`` does. The baselines:

* ``memcpy``: the same blocks copied between two buffers of this process
  (``memmove`` per block, one thread), numpy arrays (huge pages where THP allows);
* ``memcpy memfd``: the same, to and from a memfd mapping of this process: what a
  copy through shared memory can reach where shmem gets 4 KiB pages;
* ``raw pvm``: the same blocks with ``process_vm_readv``/``writev`` against the cma
  target's buffer, all blocks of a batch in one call (IOV_MAX rows): the best one
  thread can do with cross-memory attach, with no checks and no completions.

Systems take turns batch by batch (one batch of each, then the next), so load
from other processes hits them alike; each cell is the median of ``--rounds``
rounds of ``--bytes`` per system. Ratios within one run are what to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import mmap
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from moriio_async import CmaOptions, IOEngine, IOEngineConfig, Session

REGION = 256 << 20
CASES = [(64 << 10, 128), (1 << 20, 16), (16 << 20, 4)]
IOV_MAX = 1024


def offsets(n: int, size: int, seed: int) -> list[int]:
    slots = REGION // (2 * size)
    return [int(x) * 2 * size for x in np.random.default_rng(seed).permutation(slots)[:n]]


# -- targets (their own processes) ---------------------------------------------------------------


def _engine_target(pipe: Any, backend: str) -> None:
    async def main() -> None:
        buf = np.full(REGION, 3, dtype=np.uint8)
        async with IOEngine(f"bench-{backend}-target", IOEngineConfig(backend=backend)) as engine:
            engine.register_memory(buf, name="kv")
            if backend == "cma":
                _desc, shm = engine.allocate_memory(REGION, name="shm")
                np.frombuffer(shm, np.uint8)[:] = 3  # fault its pages in, as a used KV pool would be
            pipe.send({"address": engine.address, "pid": os.getpid(), "kv": buf.ctypes.data})
            await engine.recv_notification()

    asyncio.run(main())


def _mooncake_target(pipe: Any) -> None:
    from mooncake.engine import TransferEngine  # type: ignore[import-untyped]

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""):
        raise SystemExit("mooncake: initialize failed")
    buf = np.full(REGION, 3, dtype=np.uint8)
    if engine.register_memory(buf.ctypes.data, buf.nbytes):
        raise SystemExit("mooncake: register_memory failed")
    pipe.send({"session": f"127.0.0.1:{engine.get_rpc_port()}", "addr": buf.ctypes.data})
    pipe.recv()


# -- one batch of each system -----------------------------------------------------------------------

Batch = Callable[[str, list[int], list[int], int], Awaitable[float]]


def memcpy_batch(src: np.ndarray, dst: np.ndarray) -> Batch:
    async def run(op: str, local: list[int], remote: list[int], size: int) -> float:
        a, b = (src, dst) if op == "write" else (dst, src)  # write: local -> "remote"
        s, d = a.ctypes.data, b.ctypes.data
        start = time.perf_counter()
        for lo, ro in zip(local, remote, strict=True):
            ctypes.memmove(d + ro, s + lo, size)
        return time.perf_counter() - start

    return run


def raw_batch(pid: int, remote_base: int, local_buf: np.ndarray) -> Batch:
    from moriio_async.backends.cma.kernel import process_vm

    async def run(op: str, local: list[int], remote: list[int], size: int) -> float:
        start = time.perf_counter()
        for i in range(0, len(local), IOV_MAX):
            lo = np.array(local[i : i + IOV_MAX], dtype=np.uint64)
            ro = np.array(remote[i : i + IOV_MAX], dtype=np.uint64)
            liov = np.stack([lo + np.uint64(local_buf.ctypes.data), np.full_like(lo, size)], axis=1)
            riov = np.stack([ro + np.uint64(remote_base), np.full_like(ro, size)], axis=1)
            got, err = process_vm(pid, op == "write", np.ascontiguousarray(liov), np.ascontiguousarray(riov))
            if err or got != size * len(lo):
                raise RuntimeError(f"process_vm: moved {got}, errno {err}")
        return time.perf_counter() - start

    return run


def session_batch(session: Session, depth: int) -> Batch:
    """One batch (``depth`` 1), or ``4 * depth`` batches with ``depth`` kept in flight: the time per batch."""

    async def run(op: str, local: list[int], remote: list[int], size: int) -> float:
        call = session.batch_write if op == "write" else session.batch_read
        sizes = [size] * len(local)
        start = time.perf_counter()
        if depth == 1:
            await call(local, remote, sizes)
            return time.perf_counter() - start
        pending: set[asyncio.Future[Any]] = set()
        for _ in range(4 * depth):
            if len(pending) >= depth:
                _done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            pending.add(asyncio.ensure_future(call(local, remote, sizes)))
        await asyncio.wait(pending)
        return (time.perf_counter() - start) / (4 * depth)

    return run


def mooncake_batch(engine: Any, target: dict[str, Any], base: int) -> Batch:
    async def run(op: str, local: list[int], remote: list[int], size: int) -> float:
        call = engine.batch_transfer_sync_write if op == "write" else engine.batch_transfer_sync_read
        start = time.perf_counter()
        rc = call(target["session"], [base + o for o in local], [target["addr"] + o for o in remote],
                  [size] * len(local))  # fmt: skip
        elapsed = time.perf_counter() - start
        if rc != 0:
            raise RuntimeError(f"mooncake {op} batch failed: {rc}")
        return elapsed

    return run


# -- the run --------------------------------------------------------------------------------------


def case(text: str) -> tuple[int, int]:
    """``64K:128`` (block size with an optional K/M suffix, then blocks per batch) as (bytes, blocks)."""
    size, _, count = text.partition(":")
    scale = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:].upper(), 1)
    try:
        return int(size.rstrip("kKmM")) * scale, int(count)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not SIZE:BLOCKS (e.g. 64K:128): {text!r}") from None


async def measure(systems: dict[str, Batch], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    if args.systems:
        systems = {name: batch for name, batch in systems.items() if name in args.systems}
    for size, n in args.cases:
        for op in ("read", "write"):
            gbps: dict[str, list[float]] = {name: [] for name in systems}
            for r in range(args.rounds + 1):  # round 0 warms everything up (connections, mappings, pages)
                lo, ro = offsets(n, size, 2 * r), offsets(n, size, 2 * r + 1)
                reps = max(1, args.bytes // (n * size))
                took = dict.fromkeys(systems, 0.0)
                for _ in range(reps):  # one batch of each system in turn: a load spike hits them alike
                    for name, batch in systems.items():
                        took[name] += await batch(op, lo, ro, size)
                if r:
                    for name in systems:
                        gbps[name].append(reps * n * size / took[name] / 1e9)
            row: dict[str, Any] = {"block": size, "blocks": n, "op": op}
            row.update({name: round(statistics.median(v), 3) for name, v in gbps.items()})
            rows.append(row)
            print(f"{size >> 10:>6} KiB x {n:<4} {op:<5} " + "  ".join(f"{k} {row[k]:.2f}" for k in systems),
                  flush=True)  # fmt: skip
    return rows


def _mooncake_usable() -> bool:
    """Mooncake imports here: installed, and its shared libraries load (it links libibverbs even
    for TCP). Tried in this process, so a target process never dies on the import while this one
    waits for its address."""
    try:
        import mooncake.engine  # type: ignore[import-untyped]  # noqa: F401
    except ImportError as exc:
        why = "pip install 'moriio-async[bench]'" if exc.name == "mooncake" else f"{exc}"
        if "libibverbs" in str(exc):
            why += " (Debian: apt-get install libibverbs1)"
        print(f"Mooncake cannot be imported ({why}): its column is skipped")
        return False
    return True


async def run(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[str]]:
    ctx = mp.get_context("spawn")
    procs: list[Any] = []
    pipes: dict[str, Any] = {}
    mooncake = not args.no_mooncake and _mooncake_usable()
    starts: list[tuple[str, Callable[..., None], tuple[Any, ...]]] = [
        ("cma", _engine_target, ("cma",)),
        ("tcp", _engine_target, ("tcp",)),
    ]
    if mooncake:
        starts.append(("mooncake", _mooncake_target, ()))
    for name, target, extra in starts:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=target, args=(child, *extra))
        proc.start()
        procs.append(proc)
        pipes[name] = parent
    notes: list[str] = []
    try:
        info = {name: pipe.recv() for name, pipe in pipes.items()}
        local = np.ones(REGION, dtype=np.uint8)
        other = np.ones(REGION, dtype=np.uint8)
        fd = os.memfd_create("samehost-memcpy")
        os.ftruncate(fd, REGION)
        shared = np.frombuffer(mmap.mmap(fd, REGION), np.uint8)  # 4 KiB pages, as a memfd's are here
        os.close(fd)
        shared[:] = 1
        systems: dict[str, Batch] = {
            "memcpy": memcpy_batch(local, other),
            "memcpy memfd": memcpy_batch(local, shared),
            "raw pvm": raw_batch(info["cma"]["pid"], info["cma"]["kv"], local),
        }
        engines: list[IOEngine] = []
        try:
            columns: list[tuple[str, str, CmaOptions]] = [
                ("cma", "cma", CmaOptions()),
                (f"cma x{args.threads}", "cma", CmaOptions(threads=args.threads)),
                ("cma worker", "cma", CmaOptions(inline_bytes=0)),  # every batch copied by the pair's worker
                ("tcp", "tcp", CmaOptions()),
            ]
            for label, backend, cma in columns:
                cfg = IOEngineConfig(backend=backend, sq_depth=1024, cma=cma)
                engine = await IOEngine(f"bench-{label.replace(' ', '')}", cfg).start()
                engines.append(engine)
                desc = engine.register_memory(local)
                peer = await engine.connect(info[backend]["address"])
                systems[label] = session_batch(await engine.create_session(desc, peer.memory["kv"]), args.depth)
                if label == "cma":
                    shm = await engine.create_session(desc, peer.memory["shm"])
                    systems["cma shm"] = session_batch(shm, args.depth)
            if mooncake:
                from mooncake.engine import TransferEngine

                mc = TransferEngine()
                if mc.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""):
                    raise SystemExit("mooncake: initialize failed")
                mc_buf = np.ones(REGION, dtype=np.uint8)
                if mc.register_memory(mc_buf.ctypes.data, mc_buf.nbytes):
                    raise SystemExit("mooncake: register_memory failed")
                systems["mooncake tcp"] = mooncake_batch(mc, info["mooncake"], mc_buf.ctypes.data)
            else:
                notes.append("Mooncake: left out (not installed, or --no-mooncake)")
            rows = await measure(systems, args)
            await engines[0].notify("bench-cma-target", b"done")
            await engines[-1].notify("bench-tcp-target", b"done")
        finally:
            for engine in engines:
                await engine.close()
        if mooncake:
            pipes["mooncake"].send("done")
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    return rows, notes


RATIOS = [
    ("cma", "raw pvm", "cma / raw pvm"),
    ("cma shm", "memcpy", "shm / memcpy"),
    ("cma shm", "memcpy memfd", "shm / memcpy memfd"),
    ("cma", "tcp", "cma / tcp"),
]


def report(rows: list[dict[str, Any]], systems: list[str], threads: int) -> None:
    ratios = [*RATIOS, (f"cma x{threads}", "cma", f"x{threads} / cma")]
    header = ["block", "op", *systems, *(r[2] for r in ratios)]
    body = []
    for row in rows:
        cells = [f"{row['block'] >> 10} KiB x {row['blocks']}", row["op"], *(f"{row[s]:.2f}" for s in systems)]
        cells += [f"{row[a] / row[b]:.2f}" if a in row and b in row else "-" for a, b, _ in ratios]
        body.append(cells)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print("  ".join(header))
        for cells in body:
            print("  ".join(cells))
        return
    table = Table(title="same host, GB/s (median round) and ratios within this run")
    for h in header:
        table.add_column(h, justify="right")
    for cells in body:
        table.add_row(*cells)
    Console(width=max(160, Console().width)).print(table)


def plot(rows: list[dict[str, Any]], systems: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['block'] >> 10} KiB\n{r['op']}" for r in rows]
    x = np.arange(len(rows))
    width = 0.8 / len(systems)
    fig, ax = plt.subplots(figsize=(12, 5))
    for i, name in enumerate(systems):
        ax.bar(x + i * width - 0.4 + width / 2, [r[name] for r in rows], width, label=name)
    ax.set_xticks(x, labels)
    ax.set_ylabel("GB/s (median round)")
    ax.set_title("same-host transfers, two processes (benchmarks/samehost.py)")
    ax.legend(ncol=4, fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds per cell (median)")
    parser.add_argument("--bytes", type=int, default=256 << 20, help="bytes per system per round")
    parser.add_argument("--depth", type=int, default=1, help="batches in flight (moriio_async columns only)")
    parser.add_argument("--threads", type=int, default=2, help="threads for the split-window cma column")
    parser.add_argument("--no-mooncake", action="store_true", help="leave Mooncake out even when installed")
    parser.add_argument("--cases", nargs="+", type=case, default=CASES, metavar="SIZE:BLOCKS",
                        help="cells to run (default: 64K:128 1M:16 16M:4)")  # fmt: skip
    parser.add_argument("--systems", nargs="+", metavar="NAME",
                        help="columns to measure (e.g. 'raw pvm' cma 'cma shm'; default: all)")  # fmt: skip
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--plot", default=os.path.join(os.path.dirname(__file__), "samehost.png"),
                        help="PNG to write (matplotlib; '' for none)")  # fmt: skip
    args = parser.parse_args(argv)
    os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake logs every connection at INFO
    print(f"same-host transfers, python {sys.version.split()[0]}, {os.cpu_count()} cpus, pid {os.getpid()}, "
          f"moriio_async batches in flight: {args.depth}")  # fmt: skip
    rows, notes = asyncio.run(run(args))
    systems = [k for k in rows[0] if k not in ("block", "blocks", "op")]
    report(rows, systems, args.threads)
    for note in notes:
        print(note)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        try:
            plot(rows, systems, args.plot)
        except ImportError:
            print("no plot: matplotlib is not installed (pip install 'moriio-async[bench]')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
