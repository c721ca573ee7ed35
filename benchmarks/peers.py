"""What a peer costs the target on the tcp backend: threads, fds, memory, connect time, rate, against peers.

    python3 benchmarks/peers.py                                   # 1, 100, 500, 1000 peers on this tree
    python3 benchmarks/peers.py --peers 1 100 500 --trees /tmp/base .   # the same per tree, alternating
    python3 benchmarks/peers.py --plot benchmarks/peers.png       # and a plot of rate and threads

For each number of peers N (and each tree, in turn, ABBA over the sizes):
one target engine (tcp backend, 127.0.0.1) runs in its own process and
exports a 4 MiB buffer; N peer engines run spread over ``--procs`` processes
(each peer an ``IOEngine`` of its own, with a session to the target). Every
child imports ``moriio_async`` from its tree (``PYTHONPATH``).

Reported, from the target's ``/proc/<pid>/status`` and ``/proc/<pid>/fd``:

* threads, fds and RSS once all N peers are connected and idle, and the
  memory per idle peer: (RSS with N peers - RSS before any) / N;
* the time to connect all N: from telling every peer process to go to the
  last one's report (each peer: ``connect`` then ``create_session``, all
  of a process's peers at once), and the target's CPU time (user and
  system, ``/proc/<pid>/stat``) over it per peer (``cpu_ms_conn``): the peers' own processes
  share the machine, so on a busy host the time says more about them;
* the aggregate 4 KiB READ rate with every peer active (``depth`` each, so
  ``N x depth`` in flight, at least ``--inflight``), and, in the same run,
  the rate of one peer alone with that same total in flight, in ABBA rounds
  of ``--seconds`` each (``--rounds``); medians, and the median of the
  per-round ratios.

Every peer dials from 127.0.0.1, so the target's caps on links and hellos (in
all and per address: ``max_links``, ``max_links_per_address``, ``max_hellos``,
``max_hellos_per_address``, ``TcpOptions.max_data_hellos``,
``.max_data_hellos_per_address``) are raised for N peers on every tree alike;
``--defaults`` runs the target with its tree's own defaults instead (see
docs/limits.md). A READ that fails ends its lane and is counted (``errors``).
Figures compare only within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import select
import statistics
import subprocess
import sys
import time
from typing import Any

SIZE = 4096
BUF = 4 << 20
HERE = os.path.abspath(__file__)


# -- the children ------------------------------------------------------------------------------------


def _raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def _stdin_lines() -> asyncio.Queue[str]:
    """Lines from stdin on the loop (a reader, not an executor thread: the target's threads are counted)."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    fd = sys.stdin.fileno()
    os.set_blocking(fd, False)
    pending = bytearray()

    def readable() -> None:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        if not data:
            loop.remove_reader(fd)
            queue.put_nowait("quit")
            return
        pending.extend(data)
        while b"\n" in pending:
            line, _, rest = pending.partition(b"\n")
            pending[:] = rest
            queue.put_nowait(line.decode())

    loop.add_reader(fd, readable)
    return queue


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def run_target(peers: int, defaults: bool, reactor_threads: int | None) -> None:
    import numpy as np

    from moriio_async import IOEngine, IOEngineConfig
    from moriio_async.backends.options import TcpOptions

    own = {} if reactor_threads is None else {"reactor_threads": reactor_threads}
    if defaults:
        config = IOEngineConfig(backend="tcp", host="127.0.0.1", tcp=TcpOptions(**own))
    else:  # every cap on links and hellos (in all, and per address) raised for N peers from 127.0.0.1
        n = max(1024, 2 * peers)
        config = IOEngineConfig(backend="tcp", host="127.0.0.1", max_links=n, max_links_per_address=n, max_hellos=n,
                                max_hellos_per_address=n, max_peers=n,
                                tcp=TcpOptions(max_data_hellos=n, max_data_hellos_per_address=n, **own))  # fmt: skip
    engine = await IOEngine("target", config).start()
    buf = np.ones(BUF, dtype=np.uint8)
    engine.register_memory(buf, name="buf")
    lines = await _stdin_lines()
    _say({"address": engine.address})
    while await lines.get() != "quit":
        pass
    sys.stdout.flush()
    os._exit(0)  # closing a thousand links is not what is measured


async def run_peers(address: str, count: int, first: int) -> None:
    import numpy as np

    from moriio_async import IOEngine, IOEngineConfig, Session

    config = IOEngineConfig(backend="tcp", host="127.0.0.1")
    engines = await asyncio.gather(*(IOEngine(f"peer-{first + i}", config).start() for i in range(count)))
    bufs = [np.zeros(BUF // 16, dtype=np.uint8) for _ in engines]
    locals_ = [e.register_memory(b, name="") for e, b in zip(engines, bufs, strict=True)]
    lines = await _stdin_lines()
    _say({"ready": count})
    sessions: list[Session] = []

    async def connect(engine: IOEngine, local: Any) -> Session:
        peer = await engine.connect(address)
        return await engine.create_session(local, peer.memory["buf"])

    while (line := await lines.get()) != "quit":
        cmd, *args = line.split()
        if cmd == "connect":
            t0 = time.perf_counter()
            made = await asyncio.gather(*(connect(e, m) for e, m in zip(engines, locals_, strict=True)),
                                        return_exceptions=True)  # fmt: skip
            sessions = [s for s in made if isinstance(s, Session)]
            failed = [repr(s) for s in made if not isinstance(s, Session)]
            _say({"connected": time.perf_counter() - t0, "failed": len(failed), "why": failed[:1]})
        elif cmd == "run":
            active, depth, seconds = int(args[0]), int(args[1]), float(args[2])
            t0 = time.perf_counter()
            until = time.monotonic() + seconds
            done = await asyncio.gather(*(lane(s, j, until) for s in sessions[:active] for j in range(depth)))
            _say({"ops": sum(done), "seconds": time.perf_counter() - t0, "errors": len(ERRORS), "why": ERRORS[:1]})
            ERRORS.clear()
    os._exit(0)


ERRORS: list[str] = []


async def lane(session: Any, slot: int, until: float) -> int:
    """One READ in flight at a time until ``until``; how many completed (a failed one ends the lane)."""
    off = (slot * SIZE) % (BUF // 16 - SIZE)
    n = 0
    while time.monotonic() < until:
        try:
            await session.read(off, off, SIZE)
        except Exception as exc:  # counted and shown: a failure must not pass for a slow rate
            ERRORS.append(repr(exc))
            return n
        n += 1
    return n


# -- the parent --------------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User and system CPU the process has used (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_figures(pid: int) -> dict[str, int]:
    status = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            status[key] = value.split()[0] if value.split() else ""
    return {"threads": int(status["Threads"]), "rss_kb": int(status["VmRSS"]),
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}  # fmt: skip


class Child:
    def __init__(self, tree: str | None, args: list[str]) -> None:
        env = dict(os.environ)
        if tree is not None:
            env["PYTHONPATH"] = tree
        self.proc = subprocess.Popen([sys.executable, HERE, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, text=True, bufsize=1)  # fmt: skip

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def read(self, timeout: float = 300.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            raise RuntimeError(f"child {self.proc.args[2:]} ended or went silent")
        out: dict[str, Any] = json.loads(line)
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            with_stdin = self.proc.stdin
            if with_stdin is not None:
                with contextlib.suppress(BrokenPipeError):
                    self.send("quit")
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def one_size(
    tree: str | None, n: int, procs: int, inflight: int, seconds: float, rounds: int, extra: list[str]
) -> dict[str, Any]:
    target = Child(tree, ["--role", "target", "--count", str(n), *extra])
    children: list[Child] = []
    try:
        address = target.read()["address"]
        time.sleep(0.5)
        before = proc_figures(target.proc.pid)
        split = [n // procs + (1 if i < n % procs else 0) for i in range(min(procs, n))]
        first = 0
        for k in split:
            children.append(Child(tree, ["--role", "peers", "--address", address, "--count", str(k),
                                         "--first", str(first)]))  # fmt: skip
            first += k
        for c in children:
            c.read()  # ready: its engines are up
        t0, cpu0 = time.perf_counter(), cpu_seconds(target.proc.pid)
        for c in children:
            c.send("connect")
        failed = [r for r in (c.read() for c in children) if r["failed"]]
        if failed:
            raise RuntimeError(f"{sum(r['failed'] for r in failed)} peer(s) did not connect: {failed[0]['why']}")
        connect_s = time.perf_counter() - t0
        connect_cpu = cpu_seconds(target.proc.pid) - cpu0
        time.sleep(1.0)
        idle = proc_figures(target.proc.pid)
        depth = max(1, -(-inflight // n))
        total = depth * n
        per: dict[str, list[float]] = {"all": [], "one": []}
        errors, why = 0, []
        for mode in ("all", "one", "one", "all") * rounds:  # ABBA: neither always runs first
            if mode == "all":
                for c, k in zip(children, split, strict=True):
                    c.send(f"run {k} {depth} {seconds}")
                replies = [c.read() for c in children]
            else:
                children[0].send(f"run 1 {total} {seconds}")
                replies = [children[0].read()]
            rate = sum(r["ops"] / r["seconds"] for r in replies)
            errors += sum(r["errors"] for r in replies)
            why = why or next((r["why"] for r in replies if r["errors"]), [])
            per[mode].append(rate)
        rates = {mode: statistics.median(r) for mode, r in per.items()}
        ratios = [a / o for a, o in zip(per["all"], per["one"], strict=True)]
        return {
            "peers": n, "threads": idle["threads"], "fds": idle["fds"], "rss_mb": idle["rss_kb"] / 1024,
            "kb_per_peer": (idle["rss_kb"] - before["rss_kb"]) / n, "connect_s": connect_s,
            "cpu_ms_conn": 1e3 * connect_cpu / n,
            "in_flight": total, "rate_all": rates["all"], "rate_one": rates["one"],
            "ratio": statistics.median(ratios), "errors": errors, "why": why,
        }  # fmt: skip
    finally:
        for c in children:
            c.close()
        target.close()


COLUMNS = (
    "peers",
    "threads",
    "fds",
    "rss_mb",
    "kb_per_peer",
    "connect_s",
    "cpu_ms_conn",
    "in_flight",
    "rate_all",
    "rate_one",
    "ratio",
    "errors",
)


def print_rows(rows: list[dict[str, Any]], header: bool = True) -> None:
    if header:
        print(f"{'tree':>14} " + " ".join(f"{c:>11}" for c in COLUMNS))
    for row in rows:
        cells = [f"{row[c]:>11.3g}" if isinstance(row[c], float) else f"{row[c]:>11}" for c in COLUMNS]
        print(f"{row['tree']:>14} " + " ".join(cells))


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for tree in dict.fromkeys(r["tree"] for r in rows):
        mine = sorted((r for r in rows if r["tree"] == tree), key=lambda r: r["peers"])
        xs = [r["peers"] for r in mine]
        ax1.plot(xs, [r["ratio"] for r in mine], marker="o", label=tree)
        ax2.plot(xs, [r["threads"] for r in mine], marker="o", label=tree)
    ax1.set(xlabel="peers", ylabel="4 KiB READ rate, all peers / one peer", title="rate against peers")
    ax1.axhline(0.9, color="grey", linestyle=":")
    ax2.set(xlabel="peers", ylabel="target threads", title="threads against peers", yscale="log")
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, nargs="+", default=[1, 100, 500, 1000])
    ap.add_argument("--procs", type=int, default=4, help="peer processes (peers spread evenly)")
    ap.add_argument("--inflight", type=int, default=64, help="least total READs in flight")
    ap.add_argument("--seconds", type=float, default=1.0, help="per rate measurement")
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds of all peers / one peer (medians)")
    ap.add_argument("--trees", nargs="+", help="checkouts to import moriio_async from, alternating")
    ap.add_argument("--plot", help="save a plot of rate and threads against peers here")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--defaults", action="store_true", help="the target with its tree's default caps")
    ap.add_argument("--reactor-threads", type=int, help="TcpOptions.reactor_threads on the target (trees that have it)")
    ap.add_argument("--role", choices=["target", "peers"], help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    _raise_nofile()
    if args.role == "target":
        asyncio.run(run_target(args.count, args.defaults, args.reactor_threads))
        return 0
    if args.role == "peers":
        asyncio.run(run_peers(args.address, args.count, args.first))
        return 0
    # Without --trees: this checkout (not whatever moriio_async the interpreter would find installed).
    trees: list[str | None] = [os.path.abspath(t) for t in args.trees or [os.path.dirname(os.path.dirname(HERE))]]
    rows: list[dict[str, Any]] = []
    for i, n in enumerate(args.peers):
        for tree in trees if i % 2 == 0 else trees[::-1]:
            extra = (["--defaults"] if args.defaults else []) + (
                [] if args.reactor_threads is None else ["--reactor-threads", str(args.reactor_threads)]
            )
            row = one_size(tree, n, args.procs, args.inflight, args.seconds, args.rounds, extra)
            row["tree"] = os.path.basename(tree.rstrip("/")) if tree else "."
            rows.append(row)
            print_rows([row], header=len(rows) == 1)
            sys.stdout.flush()
    print()
    print_rows(sorted(rows, key=lambda r: (r["peers"], r["tree"])))
    for row in rows:
        if row["errors"]:
            print(f"{row['tree']} at {row['peers']} peers: {row['errors']} lane(s) failed, e.g. {row['why']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
