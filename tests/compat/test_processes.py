"""Real processes: the ported examples, and a striped batch whose peer is killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from moriio_async import IOEngineConfig as AsyncEngineConfig
from moriio_async.compat.mori import (
    BackendType,
    EngineDesc,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    RdmaBackendConfig,
    StatusCode,
)

ROOT = Path(__file__).parents[2]


def run(*argv: str) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120, env=env, check=False)
    return proc.returncode, proc.stdout + proc.stderr


def test_mori_io_example() -> None:
    code, out = run(str(ROOT / "examples" / "mori_io_example.py"))
    assert code == 0, out
    for flow in ("basic read/write", "batch read/write", "session batch read/write"):
        assert f"{flow} status: success" in out, out


def test_a_striped_batch_to_a_killed_peer_fails_and_every_wait_returns() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    peer = subprocess.Popen(
        [sys.executable, "-m", "tests.compat.peer"], cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert peer.stdout is not None
    hello = json.loads(peer.stdout.readline())
    options = AsyncEngineConfig(backend="tcp", retry_timeout=1.0, control_timeout=2.0)
    engine = IOEngine("initiator", IOEngineConfig("127.0.0.1", 0, options=options))
    try:
        engine.create_backend(BackendType.TCP, RdmaBackendConfig(qp_per_transfer=2))
        engine.register_remote_engine(EngineDesc.unpack(bytes.fromhex(hello["engine"])))
        remote = MemoryDesc.unpack(bytes.fromhex(hello["mem"]))
        local = engine.register_torch_tensor(np.ones(1 << 20, dtype=np.uint8))
        session = engine.create_session(local, remote)
        assert session is not None
        offsets = list(range(0, 1 << 20, 8192))
        assert session.batch_write(offsets, offsets, [4096] * len(offsets)).WaitFor(10_000) is StatusCode.SUCCESS
        assert session.alive()
        os.kill(peer.pid, signal.SIGKILL)
        peer.wait(10)
        t0 = time.monotonic()
        statuses = [session.batch_write(offsets, offsets, [4096] * len(offsets)) for _ in range(4)]
        for status in statuses:
            status.Wait()
        assert all(s.Code() is StatusCode.ERR_RDMA_OP for s in statuses), [s.Message() for s in statuses]
        assert time.monotonic() - t0 < 30
        assert engine.wait_all(statuses, 0) is StatusCode.ERR_RDMA_OP
        assert not session.alive()
    finally:
        engine.close()
        if peer.poll() is None:
            peer.kill()
            peer.wait()
        for pipe in (peer.stdin, peer.stdout):
            if pipe is not None:
                pipe.close()
