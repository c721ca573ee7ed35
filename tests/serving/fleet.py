"""Helpers for the process-level serving tests: the demo as a subprocess, and a ``--serve`` fleet."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from moriio_async.serving.model import Model, ModelConfig, decode_text, encode

ROOT = Path(__file__).parents[2]
MODEL = ModelConfig(d_model=64, n_layers=2, n_heads=2, d_ff=128, block_size=16, max_model_len=256)
MODEL_FLAGS = [
    *("--d-model", "64", "--layers", "2", "--heads", "2", "--d-ff", "128"),
    *("--block-size", "16", "--max-model-len", "256"),
]
"""A small model, so the whole tests/serving run stays within a few minutes on two cores."""
LOAD_FLAGS = [
    "--requests",
    "12",
    "--concurrency",
    "4",
    "--max-tokens",
    "16",
    "--min-prompt",
    "32",
    "--max-prompt",
    "200",
]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}


def reference(prompt: str, max_tokens: int) -> str:
    return decode_text(Model(MODEL).generate(encode(prompt), max_tokens))


def run_demo(tmp_path: Path, *flags: str, timeout: float = 150) -> tuple[int, str, dict[str, Any]]:
    """``python -m moriio_async.serving demo`` with the small model; (exit status, output, its JSON)."""
    out = tmp_path / "demo.json"
    argv = [sys.executable, "-m", "moriio_async.serving", "demo", *MODEL_FLAGS, *LOAD_FLAGS]
    argv += ["--json", str(out), "--log-dir", str(tmp_path / "logs"), *flags]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env(), check=False)
    text = proc.stdout + proc.stderr
    summary = json.loads(out.read_text()) if out.exists() else {}
    return proc.returncode, text, summary


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@dataclass
class ServedFleet:
    """``demo --serve``: a proxy over one prefill and one decode instance, for real clients."""

    proc: subprocess.Popen[str]
    url: str
    mode: str
    log_dir: Path

    def instances(self) -> list[dict[str, Any]]:
        body: list[dict[str, Any]] = httpx.get(f"{self.url}/health", timeout=5).json()["instances"]
        return body

    def stop(self) -> tuple[int, list[int]]:
        """Ctrl-C the demo; its exit status and the instance processes still alive afterwards."""
        pids = [i["pid"] for i in self.instances()]
        self.proc.send_signal(signal.SIGINT)
        code = self.proc.wait(timeout=30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        deadline = time.monotonic() + 5
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        return code, [p for p in pids if alive(p)]


def serve(tmp_path: Path, mode: str, *flags: str) -> ServedFleet:
    log_dir = tmp_path / f"serve-{mode}"
    argv = [sys.executable, "-m", "moriio_async.serving", "demo", "--serve", "--port", "0", "--mode", mode]
    argv += [*MODEL_FLAGS, "--log-dir", str(log_dir), *flags]
    with (tmp_path / f"serve-{mode}.err").open("w") as stderr:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env())
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("serving at "):
        proc.kill()
        proc.wait()
        proc.stdout.close()
        raise AssertionError(f"demo --serve did not start: {line!r}\n{(tmp_path / f'serve-{mode}.err').read_text()}")
    return ServedFleet(proc, line.split()[-1], mode, log_dir)
