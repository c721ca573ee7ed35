"""Loading pyverbs (with the root logger left as it was), its version, and its errors as ``VerbsError``."""

from __future__ import annotations

import importlib.metadata
import logging
from typing import Any

from ....errors import BackendUnavailable
from ..values import INSTALL_HINT, NO_DEVICE_HINT, VerbsError

__all__ = [
    "PYVERBS_VERSION", "PyverbsError", "addr", "close", "cq", "device", "errno_of", "fail", "has_channel_fd",
    "list_devices", "mr", "pd", "qp", "wr",
]  # fmt: skip


def _import() -> tuple[Any, ...]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        import pyverbs
        import pyverbs.addr as addr_mod
        import pyverbs.cq as cq_mod
        import pyverbs.device as device_mod
        import pyverbs.mr as mr_mod
        import pyverbs.pd as pd_mod
        import pyverbs.qp as qp_mod
        import pyverbs.wr as wr_mod
        from pyverbs.pyverbs_error import PyverbsError
    except ImportError as exc:
        raise BackendUnavailable(f"pyverbs cannot be imported: {exc}", hint=INSTALL_HINT) from exc
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return pyverbs, addr_mod, cq_mod, device_mod, mr_mod, pd_mod, qp_mod, wr_mod, PyverbsError


pyverbs, addr, cq, device, mr, pd, qp, wr, PyverbsError = _import()


def _version() -> str:
    try:
        return importlib.metadata.version("pyverbs")
    except importlib.metadata.PackageNotFoundError:
        return str(getattr(pyverbs, "__version__", "") or "unknown (no package metadata)")


PYVERBS_VERSION: str = _version()


def errno_of(exc: BaseException) -> int:
    code = getattr(exc, "error_code", -1)
    return code if isinstance(code, int) and code > 0 else 0


def fail(what: str, exc: BaseException, hint: str | None = None) -> VerbsError:
    """A pyverbs exception as the ``VerbsError`` the backend handles, with its errno."""
    return VerbsError(f"{what}: {exc}", errno=errno_of(exc), hint=hint)


def close(handle: Any, what: str) -> None:
    """``handle.close()`` (a pyverbs object), its pyverbs error raised as the ``VerbsError`` naming ``what``."""
    try:
        handle.close()
    except PyverbsError as exc:
        raise fail(what, exc) from exc


def has_channel_fd() -> bool:
    """Whether ``CompChannel`` has ``.fd`` (rdma-core 57 and later)."""
    return hasattr(cq.CompChannel, "fd")


def list_devices() -> list[str]:
    """Names of the RDMA devices; ``BackendUnavailable`` when there are none."""
    try:
        devices = device.get_device_list()
    except PyverbsError as exc:
        raise BackendUnavailable(
            f"no RDMA devices: {exc} (this kernel has no RDMA support or no RDMA driver is loaded)",
            hint=NO_DEVICE_HINT,
        ) from exc
    names = [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices]
    if not names:
        raise BackendUnavailable("no RDMA devices found", hint=NO_DEVICE_HINT)
    return names
