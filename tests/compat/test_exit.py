"""A process that exits with compat engines still open (vLLM never closes its engine) exits silently and
releases everything: the engines' exit cleanup runs the backends' close (``tests/compat/exiting.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize("mode", ["idle", "session", "in-flight"])
@pytest.mark.parametrize("backend", ["tcp", "cma", "auto"])
def test_exiting_with_engines_open_is_silent_and_releases_everything(backend: str, mode: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.compat.exiting", backend, mode],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    ready, *reports = proc.stdout.splitlines()
    assert ready == "ready"
    # Sockets (listeners, links, queue pairs), memfds (cma's region tables) and threads (accept, receivers,
    # the loop threads) all gone: each backend's close ran, and already before concurrent.futures stopped the
    # executors (a close that needs one works; a thread busy in one does not hold the exit before the close).
    nothing = {"threads": [], "sockets": [], "memfds": []}
    assert [json.loads(line) for line in reports] == [{"when": w, **nothing} for w in ("threading exit", "atexit")]


CLOSERS = """
import logging, sys, weakref
logging.basicConfig(stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")
from moriio_async.compat.mori.loop import close_before_exit

class Engine:
    pass

engines = [Engine() for _ in range(3)]

def close(i):
    print(f"closed {i}", flush=True)
    if i == 1:
        raise RuntimeError("the backend refused")

for i, engine in enumerate(engines):
    close_before_exit(weakref.finalize(engine, close, i))
print("exiting", flush=True)
"""


def test_at_exit_engines_close_newest_first_and_one_that_fails_is_logged_without_stopping_the_rest() -> None:
    """``close_before_exit``'s order: the reverse of registration, as atexit's; a failing close is logged and
    the older engines still close."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", CLOSERS], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["exiting", "closed 2", "closed 1", "closed 0"]
    assert proc.stderr.startswith("ERROR moriio_async moriio_async compat: closing an engine at exit failed\n")
    assert proc.stderr.rstrip().endswith("RuntimeError: the backend refused")
