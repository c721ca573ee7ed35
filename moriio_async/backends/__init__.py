"""Backends, imported lazily by name so a missing optional dependency costs nothing until asked for."""

from __future__ import annotations

import importlib

from ..errors import BackendUnavailable
from .base import Backend, BackendOptions

__all__ = ["BACKENDS", "open_backend"]


BACKENDS = {
    "tcp": "moriio_async.backends.tcp",
    "verbs": "moriio_async.backends.verbs",
    "mock": "moriio_async.backends.mock",
    "cma": "moriio_async.backends.cma",
}


def open_backend(name: str, options: BackendOptions) -> Backend:
    """Open one backend, ``name`` ("tcp", "verbs", "cma" or "mock"). The engine's ``backend="auto"`` opens
    several (``engine/transports.py``), so "auto" is not a name here."""
    module_name = BACKENDS.get(name)
    if module_name is None:
        raise BackendUnavailable(f"unknown backend {name!r}", hint=f"choose one of {sorted(BACKENDS)}")
    module = importlib.import_module(module_name)
    opened: Backend = module.open_backend(options)
    return opened
