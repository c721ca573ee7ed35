"""The host-side bridge: run the real-verbs suite inside the Soft-RoCE guest, once, and report each test here.

On the host, collection asks pytest (in a subprocess, with MORIIO_GUEST=1) which
tests the guest will run, and makes one item per guest test. The first item
to run boots the guest once for the session (``tools/guest/run.py``) with
pytest writing JUnit XML into the shared results directory; every item then
passes, fails (with the guest's failure text) or skips as its guest twin did.

Without the means to run the guest (``run.py --check`` says why) there is
exactly one item: skipped with that line, or failed when CI=true, because in
CI a guest that cannot be built or booted is a failure. Inside the guest this
file collects nothing.

MORIIO_GUEST_SUITE narrows what runs in the guest (pytest paths, space-separated);
MORIIO_GUEST_RUN points at another run.py (the tests of this bridge use a missing one).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN = Path(os.environ.get("MORIIO_GUEST_RUN", str(REPO / "tools" / "guest" / "run.py")))
IN_GUEST = os.environ.get("MORIIO_GUEST") == "1"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
DEFAULT_SUITE = (
    "tests/verbs/test_real_verbs.py tests/verbs/test_peer_failure.py tests/backends tests/engine/test_transfers.py"
)
SUITE = os.environ.get("MORIIO_GUEST_SUITE", DEFAULT_SUITE).split()
GUEST_ENV = {
    "MORIIO_TEST_BACKENDS": "verbs",
    "MORIIO_TEST_ENGINE_BACKENDS": "verbs",
    "MORIIO_TEST_BACKEND_OPTIONS": '{"device": "rxe0"}',
}
RUN_TIMEOUT = float(os.environ.get("MORIIO_GUEST_TIMEOUT", "1500"))
BRIDGE = "tests/verbs/test_guest_suite.py"


def _cannot_run() -> str | None:
    if not RUN.exists():
        return f"{RUN} is missing"
    try:
        check = subprocess.run(
            [sys.executable, str(RUN), "--check"], capture_output=True, text=True, timeout=120, cwd=REPO
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"tools/guest/run.py --check could not run: {exc}"
    if check.returncode == 0:
        return None
    text = (check.stdout + check.stderr).strip().splitlines()
    return text[-1] if text else f"tools/guest/run.py --check exited {check.returncode}"


def _guest_test_ids() -> list[str]:
    """Node ids the guest will run, by collecting on the host as the guest would."""
    env = dict(os.environ, MORIIO_GUEST="1", **GUEST_ENV)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *SUITE],
        capture_output=True, text=True, timeout=300, cwd=REPO, env=env,
    )  # fmt: skip
    ids = [line for line in result.stdout.splitlines() if "::" in line and not line.startswith(BRIDGE)]
    if not ids:
        raise RuntimeError(f"collecting the guest suite found nothing:\n{result.stdout}\n{result.stderr}")
    return ids


def _junit_key(nodeid: str) -> tuple[str, str]:
    """(classname, name) as pytest's JUnit XML spells a node id."""
    path, *rest = nodeid.split("::")
    names = [path.removesuffix(".py").replace("/", "."), *rest]
    return ".".join(names[:-1]), names[-1]


@dataclass(frozen=True)
class GuestResult:
    outcome: str  # passed | failed | skipped
    text: str
    seconds: float


@dataclass
class GuestRun:
    results: dict[tuple[str, str], GuestResult]
    exit_code: int
    seconds: float
    log_tail: str


def _parse(xml_path: Path) -> dict[tuple[str, str], GuestResult]:
    results = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        key = (case.get("classname", ""), case.get("name", ""))
        outcome, text = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, text = "failed", f"{child.get('message', '')}\n{child.text or ''}"
            elif child.tag == "skipped":
                outcome, text = "skipped", child.get("message", "")
        results[key] = GuestResult(outcome, text.strip(), float(case.get("time", "0") or 0))
    return results


def _run_guest() -> GuestRun:
    out = Path(tempfile.mkdtemp(prefix="moriio-guest-"))
    xml = out / "guest-junit.xml"
    pytest_cmd = [
        "python", "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEs", "--junitxml", str(xml),
        "--deselect", BRIDGE, *SUITE,
    ]  # fmt: skip
    env = dict(os.environ, **GUEST_ENV)
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(RUN), "--out", str(out), "--timeout", str(RUN_TIMEOUT), "--", *pytest_cmd],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=RUN_TIMEOUT + 600,
    )  # fmt: skip
    seconds = time.monotonic() - started
    log = proc.stdout + proc.stderr
    (out / "run.log").write_text(log)
    tail = "\n".join(log.splitlines()[-60:])
    sys.stderr.write(f"\n[guest] {shlex.join(pytest_cmd)}: exit {proc.returncode} after {seconds:.0f}s (log {out})\n")
    if not xml.exists():
        raise RuntimeError(f"the guest run wrote no JUnit XML (exit {proc.returncode}); last lines:\n{tail}")
    return GuestRun(_parse(xml), proc.returncode, seconds, tail)


_run: GuestRun | None = None
_run_error: str | None = None


def _guest_run() -> GuestRun:
    global _run, _run_error
    if _run is None and _run_error is None:
        try:
            _run = _run_guest()
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            _run_error = str(exc)
    if _run is None:
        pytest.fail(f"the Soft-RoCE guest run failed: {_run_error}", pytrace=False)
    return _run


def _items() -> list[object]:
    if IN_GUEST:
        return []
    reason = _cannot_run()
    if reason is not None:
        line = f"Soft-RoCE guest unavailable: {reason} (check: python3 tools/guest/run.py --check)"
        marks = [] if IN_CI else [pytest.mark.skip(reason=line)]
        return [pytest.param(f"unavailable::{line}", id="guest-unavailable", marks=marks)]
    try:
        ids = _guest_test_ids()
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return [pytest.param(f"unavailable::{exc}", id="guest-collection")]
    return [pytest.param(nodeid, id=re.sub(r"^tests/", "", nodeid)) for nodeid in ids]


@pytest.mark.timeout(RUN_TIMEOUT + 900)
@pytest.mark.guest
@pytest.mark.parametrize("guest_test", _items())
def test_in_guest(guest_test: str) -> None:
    if guest_test.startswith("unavailable::"):
        pytest.fail(guest_test.removeprefix("unavailable::"), pytrace=False)
    run = _guest_run()
    result = run.results.get(_junit_key(guest_test))
    if result is None:
        pytest.fail(
            f"{guest_test} did not run in the guest (guest exit {run.exit_code}); last lines:\n{run.log_tail}",
            pytrace=False,
        )
    if result.outcome == "failed":
        pytest.fail(f"in the guest ({result.seconds:.1f}s): {result.text}", pytrace=False)
    if result.outcome == "skipped":
        pytest.skip(f"in the guest: {result.text}")
