"""Make ``import mori.io`` resolve to :mod:`moriio_async.compat.mori`, in whatever order modules load.

vLLM's MoRIIO modules do ``from mori.io import IOEngine, ...`` inside a ``try``
at their own import and remember a failure (``MoRIIO_enabled = False``, names
missing). Two orders must both work:

* the alias is installed first: the plain ``sys.modules`` entries are enough;
* a module that imports ``mori.io`` was imported before (another connector's
  import, a plugin, a test): it is imported again once the alias is in place,
  so its names bind to compat. Only modules that failed are reloaded.

A real ``mori`` package, when one is importable, is left alone unless
``force=True``: a host with AMD's MoRI-IO keeps it.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import types
from collections.abc import Iterable

__all__ = ["install", "installed", "reload_failed"]

log = logging.getLogger("moriio_async")


def installed() -> bool:
    """True when ``mori.io`` is this project's compat layer."""
    mod = sys.modules.get("mori.io")
    return mod is not None and mod.__name__ == "moriio_async.compat.mori"


def _real_mori_present() -> bool:
    if "mori" in sys.modules:
        return not getattr(sys.modules["mori"], "__moriio_async_alias__", False)
    try:
        return importlib.util.find_spec("mori") is not None
    except (ImportError, ValueError):
        return False


def install(*, force: bool = False) -> bool:
    """Put ``mori`` and ``mori.io`` in ``sys.modules``; False when a real MoRI-IO is kept instead."""
    if installed():
        return True
    if not force and _real_mori_present():
        log.info("a real 'mori' package is importable: vLLM's MoRIIO connector will use it, not moriio_async")
        return False
    from moriio_async.compat import mori as compat_mori

    package = types.ModuleType("mori", "moriio_async's stand-in for AMD's MoRI package (mori.io only)")
    package.__path__ = []  # a package, so `import mori.io` is a submodule import that sys.modules answers
    package.__moriio_async_alias__ = True  # type: ignore[attr-defined]
    package.io = compat_mori  # type: ignore[attr-defined]
    sys.modules["mori"] = package
    sys.modules["mori.io"] = compat_mori
    return True


def reload_failed(names: Iterable[str], *, probe: str = "IOEngine") -> list[str]:
    """Import again each already-imported module in ``names`` that lacks ``probe`` (its ``mori.io`` import failed).

    Modules not imported yet are skipped: their first import will find the
    alias. Returns the names reloaded, in the order given (give a module before
    the modules that import names from it).
    """
    done: list[str] = []
    for name in names:
        mod = sys.modules.get(name)
        if mod is None or hasattr(mod, probe):
            continue
        importlib.reload(mod)
        done.append(name)
    if done:
        log.info("imported again after mapping mori.io to moriio_async: %s", ", ".join(done))
    return done
