"""``./scripts/demo``'s job over real processes: token identity in both modes, and a killed prefill instance."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from .fleet import MODEL_FLAGS, alive, env, run_demo


def blocks_left(mode: dict[str, Any]) -> int:
    return sum(abs(n) for n in mode["leaks"].values())


@pytest.mark.parametrize(("prefill", "decode"), [(1, 1), (2, 2)])
def test_every_generation_is_token_identical_in_both_modes(tmp_path: Path, prefill: int, decode: int) -> None:
    code, out, summary = run_demo(tmp_path, "--prefill", str(prefill), "--decode", str(decode))
    assert code == 0, out
    assert [m["mode"] for m in summary["modes"]] == ["write", "read"] and summary["passed"]
    for mode in summary["modes"]:
        assert mode["requests"] == mode["ok"] == mode["identical"] == 12 and mode["mismatched"] == 0, mode
        assert blocks_left(mode) == 0 and len(mode["leaks"]) == prefill + decode
        assert mode["figures"]["KV bytes moved"] != "0.0 KiB"
    assert "token-identical to reference" in out and out.count("PASS") == 2


def test_a_killed_prefill_instance_is_retried_elsewhere_and_serves_again_after_restart(tmp_path: Path) -> None:
    code, out, summary = run_demo(
        tmp_path, "--prefill", "2", "--decode", "1", "--kill-prefill", "--transfer-timeout", "3"
    )
    assert code == 0, out
    for mode in summary["modes"]:
        kill = mode["kill"]
        assert kill["in_flight_blocks"] > 0, mode  # it died with KV of its in flight
        assert mode["failed"] == mode["unavailable"] == mode["hung"] == mode["mismatched"] == 0, mode
        assert mode["ok"] == mode["identical"] == mode["requests"] == 12 + 6  # 6: the wave after the restart
        assert mode["retried"] >= 1, mode
        assert mode["max_latency_s"] <= 3 + 1
        assert blocks_left(mode) == 0, mode
        assert kill["served_after_restart"] >= 1, mode


def test_a_killed_only_prefill_instance_gives_clear_503s_until_it_is_back(tmp_path: Path) -> None:
    code, out, summary = run_demo(tmp_path, "--kill-prefill", "--mode", "write", "--transfer-timeout", "3")
    assert code == 0, out
    (mode,) = summary["modes"]
    assert mode["unavailable"] >= 1 and mode["failed"] == mode["hung"] == mode["mismatched"] == 0, mode
    assert all(e.startswith("503: ") and "no instance could serve the request" in e for e in mode["errors"]), mode
    assert mode["identical"] == mode["ok"] >= 4  # at least the wave after the restart
    assert mode["max_latency_s"] <= 3 + 1
    assert blocks_left(mode) == 0 and mode["kill"]["served_after_restart"] >= 1, mode


def test_ctrl_c_mid_run_stops_every_process(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    argv = [sys.executable, "-m", "moriio_async.serving", "demo", *MODEL_FLAGS, "--log-dir", str(logs)]
    argv += ["--requests", "2000", "--concurrency", "4", "--max-tokens", "16", "--max-prompt", "200"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env())
    try:
        deadline = time.monotonic() + 60
        while not (logs / "proxy-write.log").exists() or "== serving at" not in (logs / "proxy-write.log").read_text():
            assert time.monotonic() < deadline and proc.poll() is None, "the demo did not start its proxy"
            time.sleep(0.05)
        time.sleep(1.0)  # requests in flight
        pids = [
            int(m) for log in logs.glob("*.log") for m in re.findall(r"== serving at \S+, pid (\d+)", log.read_text())
        ]
        assert len(pids) == 3  # prefill, decode, proxy
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if alive(p)] == []
