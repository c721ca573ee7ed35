"""A real vLLM prefill/decode pair: vLLM's own MoRIIO connector, unchanged, on moriio_async.

Each test runs ``./scripts/demo --engine vllm`` (``python -m moriio_async.serving
demo --engine vllm``) as a user would, with the official ``openai`` client
sending the load through the proxy, and reads its ``--json`` summary: READ and
WRITE mode over cma and over tcp, every generation token-identical to a plain
vLLM with the same model and seed, KV moved, no block left in use, no process
left behind; then the same load with the prefill server killed (and
restarted) or stopped past the transfer timeout (and continued): every request
ends (an answer or a 503, none hung), nothing is left in use, and the decode
server serves through the prefill server again.

vLLM lives in a venv of its own (``python -m moriio_async.serving.vllm.venv``,
about 3.5 GB, which ``.ci/run`` installs). Without it these tests skip, saying
so; with ``MORIIO_TEST_VLLM=1`` (CI) a missing venv is a failure instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from moriio_async.serving.vllm.venv import VllmEnv, default_location

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 10.0  # the connector's transfer_timeout, and the proxy's per-attempt deadline
LOAD = ["--requests", "8", "--concurrency", "4", "--max-tokens", "16", "--min-prompt", "64", "--max-prompt", "200"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module", autouse=True)
def vllm_env() -> VllmEnv:
    env = VllmEnv(default_location())
    if not env.ready():
        why = f"the vLLM venv is not installed at {env.root} (python -m moriio_async.serving.vllm.venv installs it)"
        if os.environ.get("MORIIO_TEST_VLLM") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return env


def demo(tmp_path: Path, *flags: str) -> tuple[int, str, dict[str, Any]]:
    out = tmp_path / "demo.json"
    argv = [sys.executable, "-m", "moriio_async.serving", "demo", "--engine", "vllm", *LOAD]
    argv += ["--transfer-timeout", str(TIMEOUT), "--json", str(out), "--log-dir", str(tmp_path / "logs"), *flags]
    env = {**os.environ, "COLUMNS": "200"}  # the table's rows unwrapped, as on a wide terminal
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1400, check=False, cwd=ROOT, env=env)
    text = proc.stdout + proc.stderr
    return proc.returncode, text, json.loads(out.read_text()) if out.exists() else {}


def vllm_servers() -> set[int]:
    """Pids of the vLLM OpenAI servers running on this machine now."""
    pids = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"vllm.entrypoints.openai.api_server" in cmdline.read_bytes():
                pids.add(int(cmdline.parent.name))
        except (OSError, ValueError):
            continue
    return pids


def check_clean(mode: dict[str, Any], transport: str) -> None:
    assert mode["passed"], mode["problems"]
    assert mode["requests"] == mode["ok"] == mode["identical"] == 8 and mode["mismatched"] == 0, mode
    assert mode["figures"]["KV transport"] == transport, mode["figures"]
    assert not mode["figures"]["KV bytes moved"].startswith("0.00 MiB"), mode["figures"]
    assert sum(mode["leaks"].values()) == 0, mode["leaks"]


def check_fault(mode: dict[str, Any]) -> None:
    assert mode["passed"], mode["problems"]
    assert mode["hung"] == mode["failed"] == mode["mismatched"] == 0, mode
    assert mode["ok"] == mode["identical"], mode  # whatever was answered is right; the rest got a clear 503
    assert all(e.startswith("503: ") for e in mode["errors"]), mode["errors"]
    assert mode["kill"]["served_after_restart"] >= 1, mode  # the decode server serves, the prefill server again
    assert sum(mode["leaks"].values()) == 0, mode["leaks"]


@pytest.mark.parametrize(("fault", "backend"), [("--kill-prefill", "auto"), ("--stop-prefill", "tcp")])
def test_read_and_write_are_token_identical_and_every_request_ends_when_the_prefill_server_fails(
    tmp_path: Path, fault: str, backend: str
) -> None:
    """Over cma (auto) and tcp, both modes clean first, then the same load with the prefill server killed
    (and restarted) or stopped past the transfer timeout (and continued)."""
    before = vllm_servers()
    code, out, summary = demo(tmp_path, "--mode", "both", "--backend", backend, fault)
    assert summary, out[-3000:]
    modes = {m["mode"]: m for m in summary["modes"]}
    what = "killed" if fault == "--kill-prefill" else "stopped"
    assert list(modes) == ["write", f"write, prefill {what}", "read", f"read, prefill {what}"], out[-3000:]
    for name in ("write", "read"):
        check_clean(modes[name], "cma" if backend == "auto" else "tcp")
        check_fault(modes[f"{name}, prefill {what}"])
    assert code == 0, out[-3000:]
    assert "token-identical to reference" in out
    assert vllm_servers() <= before and "processes left behind" not in out
