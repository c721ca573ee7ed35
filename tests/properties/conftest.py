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
    "verbs": "fault plans in VerbsOptions, applied at the initiator's pairs (delay, status, drop, stall; no kill)",
}
"""Which backends can inject faults, and how (test_real_faults.py uses tcp's and verbs')."""


def backends() -> pytest.MarkDecorator:
    """Parametrize a property over MORIIO_TEST_ENGINE_BACKENDS (mock, tcp, verbs)."""
    return pytest.mark.parametrize("backend", engine_backends())


def slow_examples(default: int) -> int:
    """Example count for properties that start processes or move real data: small by default,
    larger under the nightly profile."""
    return default * 10 if os.environ.get("HYPOTHESIS_PROFILE") == "nightly" else default


needs_held_mock = pytest.mark.skipif(
    "mock" not in engine_backends(),
    reason=f"drives the mock backend's NIC by hand ({FAULTS['mock']}); MORIIO_TEST_ENGINE_BACKENDS leaves mock out",
)
"""For properties whose oracle needs a NIC the test steps: they run on the mock backend only."""
