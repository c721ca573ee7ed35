"""Settings for the property suites.

Hypothesis writes a patch for each failing example with libcst, whose import
raises a DeprecationWarning (mypy_extensions.TypedDict); under the project's
warnings-as-errors that turns every property failure into a pytest
INTERNALERROR that hides it. Importing it once here, with that warning
ignored, keeps failures readable.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import pytest

from ..conftest import engine_backends

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    with contextlib.suppress(ImportError):
        import hypothesis.extra._patching  # noqa: F401

FAULTS = {
    "mock": "held requests stepped by the test, fail_next, vanish, silent completion queue",
    "tcp": "fault plans at the backend's hook seam (delay, status, drop, stall, kill)",
}
"""Which backends can inject faults, and how. The verbs backend has none: real hardware fails on its own."""


def backends(*, faults: str | None = None) -> pytest.MarkDecorator:
    """Parametrize a property over MORIIO_TEST_ENGINE_BACKENDS; with ``faults`` ("mock" or "tcp"),
    only the backend that has that fault feature runs it, and the others are skipped with the reason."""
    params = []
    for name in engine_backends():
        marks = []
        if faults is not None and name != faults:
            marks.append(pytest.mark.skip(reason=f"needs the {faults} backend's fault injection ({FAULTS[faults]})"))
        params.append(pytest.param(name, marks=marks, id=name))
    return pytest.mark.parametrize("backend", params)


def slow_examples(default: int) -> int:
    """Example count for properties that start processes or move real data: small by default,
    larger under the nightly profile."""
    return default * 10 if os.environ.get("HYPOTHESIS_PROFILE") == "nightly" else default
