"""How long a legitimate peer takes to get in under a crowd of unauthenticated sockets, and how fast one
source can guess (issue 23, items 2 and 5).

    python benchmarks/siege.py                      # 1,000 sockets, control and data port, with/without secret
    python benchmarks/siege.py --crowd 2000 --rounds 20
    python benchmarks/siege.py --guesses 3          # also: token and proof guesses a second from one source

The crowd (``tests/engine/siege.py``) holds ``--crowd`` silent or trickling
sockets to the target's control port or TCP data port, each from its own
127.1.x.y address and reopened as soon as the target closes it. Once it has
been there past every grace period, a legitimate engine connects, makes a
session and READs 64 KiB, ``--rounds`` times; the time of each round (connect
to data in) is printed as p50 / p90 / max. ``--guesses S`` then guesses, for
S seconds each, from one source (127.0.0.2): data-plane tokens (a hello
with a random token) and control-plane proofs (a hello with a wrong proof),
one at a time, and prints how many were answered a second.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import struct
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from moriio_async import IOEngine, IOEngineConfig, waiting_for_transfer_complete
from moriio_async.backends.described import TcpFacts
from tests.control.wire import hello
from tests.engine.siege import Siege, open_files

SECRET = "a-secret-for-the-siege-benchmark"


def tcp_facts(engine: IOEngine) -> TcpFacts:
    facts = engine.describe_backend()
    assert isinstance(facts, TcpFacts), facts
    return facts


async def rounds(port: str, secret: str, crowd: int, n: int) -> list[float]:
    cfg = IOEngineConfig(backend="tcp", secret=secret)
    async with IOEngine("b", cfg) as b, IOEngine("a", cfg) as a:
        b.register_memory(np.full(1 << 16, 7, np.uint8), name="kv")
        local = np.zeros(1 << 16, np.uint8)
        mine = a.register_memory(local, name="kv")
        target = int(b.address.rpartition(":")[2]) if port == "control" else tcp_facts(b).data_port
        times = []
        with Siege(target, crowd) as siege:  # all opened on entry, held (reopened) from then on
            await asyncio.sleep(cfg.hello_timeout)
            for _ in range(n):
                start = time.perf_counter()
                info = await asyncio.wait_for(a.connect(b.address), 60)
                session = await asyncio.wait_for(a.create_session(mine, info.memory["kv"]), 60)
                await waiting_for_transfer_complete([session.read(0, 0, 1 << 16)], timeout=60)
                times.append(time.perf_counter() - start)
                await session.close()
            evicted = b.statistics().guard.evicted_hellos + b.statistics().data_plane.get("evicted_hellos", 0)
            print(f"    crowd reopened {siege.closed_by_target} sockets the target closed; evicted {evicted}")
        return times


def token_guesses(port: int, seconds: float) -> int:
    answered = 0
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        with socket.socket() as s:
            s.bind(("127.0.0.2", 0))
            s.settimeout(5)
            s.connect(("127.0.0.1", port))
            s.sendall(struct.pack("<4sHH16sI", b"MRIO", 2, 0, os.urandom(16), 7))
            if s.recv(12):
                answered += 1
    return answered


async def guesses(seconds: float) -> None:
    cfg = IOEngineConfig(backend="tcp", secret=SECRET)
    async with IOEngine("b", cfg) as b:
        port = tcp_facts(b).data_port
        n = await asyncio.to_thread(token_guesses, port, seconds)
        print(f"  token guesses from one source: {n / seconds:.0f}/s ({n} in {seconds:g} s)")
        n = 0
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            said = await hello(b.address, "guesser", backend="tcp", secret=SECRET.encode(), bad_proof=True,
                               source="127.0.0.2")  # fmt: skip
            n += said.last.get("reason") == "auth"
            await said.close()
        print(f"  proof guesses from one source: {n / seconds:.0f}/s ({n} in {seconds:g} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--crowd", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--guesses", type=float, default=0.0, help="seconds of guessing per kind (0: none)")
    args = parser.parse_args()
    with open_files(4 * args.crowd + 1024):
        for port in ("control", "data"):
            for secret in ("", SECRET):
                print(f"{port} port, {'with' if secret else 'without'} a secret, crowd of {args.crowd}:")
                times = asyncio.run(rounds(port, secret, args.crowd, args.rounds))
                q = statistics.quantiles(times, n=10) if len(times) > 1 else times * 9
                print(f"  connect + session + 64 KiB READ: p50 {statistics.median(times) * 1e3:.0f} ms, "
                      f"p90 {q[8] * 1e3:.0f} ms, max {max(times) * 1e3:.0f} ms over {len(times)} rounds")  # fmt: skip
    if args.guesses:
        asyncio.run(guesses(args.guesses))


if __name__ == "__main__":
    main()
