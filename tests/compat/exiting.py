"""A process that exits with compat engines still open, as vLLM does: ``python -m tests.compat.exiting BACKEND MODE``.

``MODE`` is ``idle`` (one engine, memory registered), ``session`` (two engines, a session between them and
transfers done on it) or ``in-flight`` (the same, then transfers left running). Nothing is closed by hand.
What is still held (threads other than the main one, sockets, moriio memfds) is printed as a JSON line twice:
when threading's shutdown runs its exit hooks, just before concurrent.futures' own (which stops every
executor), and from the last ``atexit`` hook.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time

import numpy as np

from moriio_async import IOEngineConfig as AsyncEngineConfig
from moriio_async.compat.mori import BackendType, IOEngine, IOEngineConfig, RdmaBackendConfig, StatusCode


def held() -> dict[str, list[str]]:
    """What the process still holds: live threads (but the main one), open sockets and moriio memfds."""
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{name}"))
        except OSError:
            continue  # the directory's own fd, closed by now
    return {
        "threads": sorted(t.name for t in threading.enumerate() if t is not threading.main_thread()),
        "sockets": [fd for fd in fds if fd.startswith("socket:")],
        "memfds": [fd for fd in fds if fd.startswith("/memfd:moriio")],
    }


KEEP: list[object] = []
"""What the process keeps until it exits (vLLM holds its engine in a worker object for the process' lifetime)."""


def report(when: str) -> None:
    # A closed engine's idle workers end on their own, but not at once: ``close`` shuts its executors down
    # without waiting (a connect in progress must not hold the loop), and on a loaded machine an idle
    # worker may not have run yet. Give each a bounded while; one that never ends is still reported.
    deadline = time.monotonic() + 5.0
    for thread in threading.enumerate():
        if thread is not threading.main_thread():
            thread.join(max(0.0, deadline - time.monotonic()))
    print(json.dumps({"when": when, **held()}), flush=True)


def main(backend: str, mode: str) -> None:
    # Threading's exit hooks run newest first: this one runs after any the engines register below, and before
    # concurrent.futures' (registered when moriio_async was imported). CPython's own hook, as concurrent.futures uses.
    threading._register_atexit(report, "threading exit")  # type: ignore[attr-defined]
    atexit.register(report, "atexit")  # first registered, last run: after every other exit cleanup
    config = IOEngineConfig("127.0.0.1", 0, options=AsyncEngineConfig(backend=backend))
    a = IOEngine("exiting-a", config)
    a.create_backend(BackendType.RDMA, RdmaBackendConfig(qp_per_transfer=2))
    kv_a = np.arange(1 << 16, dtype=np.uint32).view(np.uint8)
    mem_a = a.register_torch_tensor(kv_a)
    if mode in ("session", "in-flight"):
        b = IOEngine("exiting-b", config)
        b.create_backend(BackendType.RDMA, RdmaBackendConfig(qp_per_transfer=2))
        a.register_remote_engine(b.get_engine_desc())
        b.register_remote_engine(a.get_engine_desc())
        kv_b = np.zeros_like(kv_a)
        mem_b = b.register_torch_tensor(kv_b)
        session = a.create_session(mem_a, mem_b)
        assert session is not None
        offsets = list(range(0, kv_a.nbytes, 8192))
        assert session.batch_write(offsets, offsets, [4096] * len(offsets)).WaitFor(10_000) is StatusCode.SUCCESS
        assert a.read(mem_a, 0, mem_b, 0, 4096).WaitFor(10_000) is StatusCode.SUCCESS
        assert held()["sockets"], "the engines hold no socket: the proof below would prove nothing"
        if mode == "in-flight":  # left running at exit: the close aborts them
            KEEP.extend(session.batch_write(offsets, offsets, [8192] * len(offsets)) for _ in range(64))
    KEEP.extend(locals().values())
    print("ready", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
