"""The examples are the README's main job: run them for real, small, and require success."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[2] / "examples"


def run(*argv: str) -> tuple[int, str]:
    # Plain (not async) tests: they run once, not once per event-loop flavour.
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120, check=False)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("mode", ["write", "read"])
def test_prefill_decode_demo(mode: str) -> None:
    code, out = run(
        str(EXAMPLES / "prefill_decode.py"),
        "--mode",
        mode,
        "--requests",
        "24",
        "--layers",
        "4",
        "--blocks",
        "64",
        "--block-kib",
        "16",
    )
    assert code == 0, out
    assert "24 requests in" in out
    assert "0 corrupted" in out


def test_two_process_transfer_example() -> None:
    code, out = run(str(EXAMPLES / "transfer.py"), "--size-mib", "16", "--block-kib", "256")
    assert code == 0, out
    assert "OK: byte-identical both ways" in out
