"""The engine pairs of tests/engine (one per backend), for the control-plane tests that run whole engines."""

from __future__ import annotations

from ..engine.conftest import backend, pair

__all__ = ["backend", "pair"]
