"""The held mock engine pair of tests/engine, for the deadline wait's tests."""

from __future__ import annotations

from ..engine.conftest import held

__all__ = ["held"]
