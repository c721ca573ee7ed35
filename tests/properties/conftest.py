"""Settings for the property suites.

Hypothesis writes a patch for each failing example with libcst, whose import
raises a DeprecationWarning (mypy_extensions.TypedDict); under the project's
warnings-as-errors that turns every property failure into a pytest
INTERNALERROR that hides it. Importing it once here, with that warning
ignored, keeps failures readable.
"""

from __future__ import annotations

import contextlib
import warnings

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    with contextlib.suppress(ImportError):
        import hypothesis.extra._patching  # noqa: F401
