"""A compat engine in a process of its own: registers 1 MiB, prints its packed descriptors, then waits.

Run as ``python -m tests.compat.peer``; the test kills it (SIGKILL) to play a dead peer.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from moriio_async.compat.mori import BackendType, IOEngine, IOEngineConfig


def main() -> None:
    engine = IOEngine("peer", IOEngineConfig("127.0.0.1", 0))
    engine.create_backend(BackendType.TCP)
    kv = np.zeros(1 << 20, dtype=np.uint8)
    mem = engine.register_torch_tensor(kv)
    print(json.dumps({"engine": engine.get_engine_desc().pack().hex(), "mem": mem.pack().hex()}), flush=True)
    sys.stdin.readline()
    engine.close()


if __name__ == "__main__":
    main()
