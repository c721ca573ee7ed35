"""Backends, imported lazily by name so a missing optional dependency costs nothing until asked for."""

from __future__ import annotations

import importlib
import logging

from ..errors import BackendUnavailable
from .base import Backend, BackendOptions

__all__ = ["BACKENDS", "open_backend"]

log = logging.getLogger("moriio_async")

BACKENDS = {
    "tcp": "moriio_async.backends.tcp",
    "verbs": "moriio_async.backends.verbs",
    "mock": "moriio_async.backends.mock",
    "cma": "moriio_async.backends.cma",
}


def open_backend(name: str, options: BackendOptions) -> Backend:
    """Open backend ``name`` ("tcp", "verbs" or "auto": verbs when a device works, else tcp)."""
    if name == "auto":
        try:
            backend = open_backend("verbs", options)
        except BackendUnavailable as exc:
            log.info("backend=auto: verbs unavailable (%s); using tcp", exc)
            return open_backend("tcp", options)
        log.info("backend=auto: using verbs")
        return backend
    module_name = BACKENDS.get(name)
    if module_name is None:
        raise BackendUnavailable(f"unknown backend {name!r}", hint=f"choose one of {sorted(BACKENDS)} or 'auto'")
    module = importlib.import_module(module_name)
    opened: Backend = module.open_backend(options)
    return opened
