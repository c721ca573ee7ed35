"""The host bridge without a guest: one skipped line normally, one failure under CI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(os.environ.get("MORIIO_GUEST") == "1", reason="host-only")


def _bridge(ci: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["MORIIO_GUEST_RUN"] = "/nonexistent/run.py"
    if ci:
        env["CI"] = "true"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", "tests/verbs/test_guest_suite.py"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=120,
    )  # fmt: skip


def test_without_a_guest_one_item_is_skipped_with_how_to_enable() -> None:
    result = _bridge(ci=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 skipped" in result.stdout
    assert "Soft-RoCE guest unavailable: /nonexistent/run.py is missing" in result.stdout
    assert "python3 tools/guest/run.py --check" in result.stdout


def test_under_ci_a_guest_that_cannot_run_is_a_failure() -> None:
    result = _bridge(ci=True)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 failed" in result.stdout
    assert "Soft-RoCE guest unavailable" in result.stdout
