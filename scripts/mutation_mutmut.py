"""``python3 -m mutmut`` with one guard, for scripts/mutation: a mutant's forked child always ends by ``os._exit``.

mutmut 3.8's default runner (``ForkRunner``, workers/isolation.py) forks one child per mutant from the
process that ran the stats and clean runs, and the child ends with ``os._exit(run_tests(...))``. It has
no ``try`` around ``run_tests``: when ``pytest.main`` raises instead of returning an exit code, the
exception unwinds the child through the copy of mutmut's own stack (``_run``, click) and the child ends
the way a process does, by ``exit()``, which runs the C libraries' destructors. uvloop's libuv has one,
``uv__threadpool_cleanup``, that joins libuv's worker threads (started in mutmut's process by the
stats run's ``getaddrinfo`` calls). A forked child has none of those threads, only their ids:
``pthread_join`` segfaults (-11) or fails and libuv aborts (-6). The report listed those mutants as
"suspicious" although their tests had failed.

``pytest.main`` raises when a warning that ``filterwarnings = ["error"]`` turns into an exception is
raised outside any test: an object with a ``__del__`` warning (an unclosed socket's ResourceWarning)
collected only at pytest's cleanup, after the last test, is raised there as
``PytestUnraisableExceptionWarning`` (``PytestUnhandledThreadExceptionWarning`` for a thread's; an
``ExceptionGroup`` of them when there are several). A
mutant that leaks a socket in a reference cycle (``_accept`` raising with an accepted socket in hand,
the test then failing with ``-x``) does exactly that. ``python3 -m pytest`` exits 1 for it, as it does
for a failed test: the same exit code is returned here, so mutmut books what the command line says.
Any other exception out of ``pytest.main`` in a mutant's child (mutmut's own exit code 4 error
included) is printed to the run's stderr and returned as 35, which mutmut and the report list as
"suspicious": a harness failure must be looked at, never counted as a kill. The clean run
(``mutant_name`` None, in mutmut's own process) is left alone: anything raised there stops the run.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Iterable
from pathlib import Path

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).parent.resolve():
    sys.path[0] = os.getcwd()  # as under `python3 -m mutmut`, whose sys.path mutmut then edits

import pytest
from mutmut.runners import harness

FAILED = 1
"""What ``python3 -m pytest`` exits with when its session ends in an uncaught exception, as for a failure."""
SUSPICIOUS = 35
"""mutmut's "suspicious" exit code."""
WARNINGS_AS_ERRORS = (pytest.PytestUnraisableExceptionWarning, pytest.PytestUnhandledThreadExceptionWarning)

_run_tests = harness.PytestRunner.run_tests


def only_warnings_as_errors(exc: BaseException) -> bool:
    """``exc`` is one of those warnings, or a group of them only (pytest raises a group for two or more)."""
    if isinstance(exc, BaseExceptionGroup):
        return all(only_warnings_as_errors(inner) for inner in exc.exceptions)
    return isinstance(exc, WARNINGS_AS_ERRORS)


def run_tests(self: harness.PytestRunner, *, mutant_name: str | None, tests: Iterable[str]) -> int:
    if mutant_name is None:
        return _run_tests(self, mutant_name=mutant_name, tests=tests)
    try:
        return _run_tests(self, mutant_name=mutant_name, tests=tests)
    except Exception as exc:
        if only_warnings_as_errors(exc):
            line = f"mutation: {mutant_name}: pytest ended with {type(exc).__name__}: exit code {FAILED}\n"
            os.write(2, line.encode())
            return FAILED
        os.write(2, f"mutation: {mutant_name}: pytest raised (suspicious):\n{traceback.format_exc()}".encode())
        return SUSPICIOUS


harness.PytestRunner.run_tests = run_tests  # type: ignore[method-assign]

if __name__ == "__main__":
    from mutmut.__main__ import cli

    sys.argv[0] = "mutmut"
    cli()
