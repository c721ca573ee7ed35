"""The host-side bridge: run the real-verbs suite inside the Soft-RoCE guest, once, and report each test here.

On the host, collection asks pytest (in a subprocess, with MORIIO_GUEST=1) which
tests the guest will run, and makes one item per guest test. The first item
of a group boots its guest(s) once for the session (``tools/guest/run.py``;
one guest for most tests, ``--guests 2`` for the two-guest ones) with pytest
writing JUnit XML into the shared results directory; every item then passes,
fails (with the guest's failure text) or skips as its guest twin did.

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
    "tests/verbs/test_real_verbs.py tests/verbs/test_peer_failure.py tests/verbs/test_batch_post.py"
    " tests/verbs/test_regions.py tests/backends tests/engine/test_transfers.py"
    # The properties that apply to a real NIC (tests/PROPERTIES.md), at the "guest" profile; the fault
    # plans through the verbs backend's seam (VerbsOptions.fault_plan) and `moriio-async faults --backend verbs`.
    " tests/properties/test_backpressure.py::test_backpressure_on_a_real_backend"
    " tests/properties/test_ordering.py::test_writes_completed_before_a_notification_are_visible_when_it_arrives"
    " tests/properties/test_bounds.py tests/properties/test_fault_plans.py tests/properties/test_real_faults.py"
)
SUITE = os.environ.get("MORIIO_GUEST_SUITE", DEFAULT_SUITE).split()
TWO_GUEST_SUITE = os.environ.get("MORIIO_GUEST_SUITE2", "tests/verbs/test_two_guests.py").split()
GROUPS = {1: SUITE, 2: TWO_GUEST_SUITE}
"""Guests per run -> the pytest paths that run there (each group boots once per session)."""
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


def _guest_test_ids(suite: list[str], guests: int) -> list[str]:
    """Node ids the guest will run, by collecting on the host as the guest would."""
    env = dict(os.environ, MORIIO_GUEST="1", MORIIO_GUEST_COUNT=str(guests), **GUEST_ENV)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *suite],
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
    devices: list[str]
    """The guests' own report of their RDMA devices (``rdma link``, port state, GID)."""


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


def _run_guest(guests: int) -> GuestRun:
    out = Path(tempfile.mkdtemp(prefix="moriio-guest-"))
    # Each guest writes its own XML; with two, a test fails if it failed in either.
    pytest_cmd = (
        'python -m pytest -p no:cacheprovider -q -rfEs --junitxml "$MORIIO_GUEST_OUT/junit-$MORIIO_GUEST_ROLE.xml" '
        f"--deselect {BRIDGE} {shlex.join(GROUPS[guests])}"
    )
    command = [sys.executable, str(RUN), "--guests", str(guests), "--out", str(out), "--timeout", str(RUN_TIMEOUT)]
    env = dict(os.environ, **GUEST_ENV)
    started = time.monotonic()
    proc = subprocess.run(
        [*command, "--", "sh", "-c", pytest_cmd],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=RUN_TIMEOUT + 600,
    )  # fmt: skip
    seconds = time.monotonic() - started
    log = proc.stdout + proc.stderr
    (out / "run.log").write_text(log)
    tail = "\n".join(log.splitlines()[-60:])
    sys.stderr.write(f"\n[guest x{guests}] {pytest_cmd}: exit {proc.returncode} after {seconds:.0f}s (log {out})\n")
    xmls = sorted(out.glob("junit-*.xml"))
    if not xmls:
        raise RuntimeError(f"the guest run wrote no JUnit XML (exit {proc.returncode}); last lines:\n{tail}")
    results: dict[tuple[str, str], GuestResult] = {}
    for xml in xmls:
        role = xml.stem.removeprefix("junit-")
        for key, result in _parse(xml).items():
            if key not in results or result.outcome == "failed":
                text = f"[guest {role}] {result.text}" if guests > 1 else result.text
                results[key] = GuestResult(result.outcome, text, result.seconds)
    devices = [line.strip() for line in log.splitlines() if re.search(r"link rxe|hca_id|state:|GID\[|active_mtu", line)]
    return GuestRun(results, proc.returncode, seconds, tail, devices)


_runs: dict[int, GuestRun] = {}
_run_errors: dict[int, str] = {}


def finished_runs() -> dict[int, GuestRun]:
    """The guest runs this session made, by number of guests (for the terminal summary)."""
    return dict(_runs)


def _guest_run(guests: int) -> GuestRun:
    if guests not in _runs and guests not in _run_errors:
        try:
            _runs[guests] = _run_guest(guests)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            _run_errors[guests] = str(exc)
    if guests not in _runs:
        pytest.fail(f"the Soft-RoCE guest run ({guests} guest(s)) failed: {_run_errors[guests]}", pytrace=False)
    return _runs[guests]


def _items() -> list[object]:
    if IN_GUEST:
        return []
    reason = _cannot_run()
    if reason is not None:
        line = f"Soft-RoCE guest unavailable: {reason} (check: python3 tools/guest/run.py --check)"
        marks = [] if IN_CI else [pytest.mark.skip(reason=line)]
        return [pytest.param(f"unavailable::{line}", id="guest-unavailable", marks=marks)]
    items: list[object] = []
    for guests, suite in GROUPS.items():
        if not suite:
            continue
        try:
            ids = _guest_test_ids(suite, guests)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            items.append(pytest.param(f"unavailable::{exc}", id=f"guest-collection-x{guests}"))
            continue
        prefix = "" if guests == 1 else f"{guests}guests/"
        items += [pytest.param(f"{guests}::{nodeid}", id=prefix + re.sub(r"^tests/", "", nodeid)) for nodeid in ids]
    return items


@pytest.mark.timeout(RUN_TIMEOUT + 900)
@pytest.mark.guest
@pytest.mark.parametrize("guest_test", _items())
def test_in_guest(guest_test: str) -> None:
    if guest_test.startswith("unavailable::"):
        pytest.fail(guest_test.removeprefix("unavailable::"), pytrace=False)
    guests, _, guest_test = guest_test.partition("::")
    run = _guest_run(int(guests))
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
