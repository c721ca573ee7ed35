"""MoRI-IO's enums with its names and values, and ``set_log_level``.

``StatusCode`` prints as pybind11 prints MoRI's enum (``StatusCode.ERR_RDMA_OP``),
so messages built with ``f"{status.Code()}"`` read as they do under MoRI-IO.
It is an ``IntEnum``: it compares equal to ``moriio_async.StatusCode`` and to ints.
"""

from __future__ import annotations

import enum
import logging

from moriio_async import StatusCode as _Code

__all__ = ["BackendType", "MemoryLocationType", "PollCqMode", "StatusCode", "set_log_level"]


class _PybindStyle(enum.IntEnum):
    """An IntEnum whose str() and format() are ``Name.MEMBER``, like a pybind11 enum."""

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec) if not spec or spec[-1:] in "s<>^" else int(self).__format__(spec)


class StatusCode(_PybindStyle):
    """A transfer's state: ``Failed()`` means a code above ``ERR_BEGIN`` (10)."""

    # The values are moriio_async's (one table, in ``moriio_async.status``); this class only adds the
    # pybind11 printing, and an IntEnum with members cannot be subclassed to add it.
    SUCCESS = _Code.SUCCESS.value
    INIT = _Code.INIT.value
    IN_PROGRESS = _Code.IN_PROGRESS.value
    ERR_INVALID_ARGS = _Code.ERR_INVALID_ARGS.value
    ERR_NOT_FOUND = _Code.ERR_NOT_FOUND.value
    ERR_RDMA_OP = _Code.ERR_RDMA_OP.value
    ERR_BAD_STATE = _Code.ERR_BAD_STATE.value
    ERR_GPU_OP = _Code.ERR_GPU_OP.value


ERR_BEGIN = 10
"""Codes above this one are failures (MoRI-IO's ``StatusCode::ERR_BEGIN``)."""


class BackendType(_PybindStyle):
    """MoRI-IO's backends. RDMA maps to the verbs backend (TCP on a host without an
    RDMA device, logged), TCP to the TCP backend; XGMI and FABRIC move GPU memory
    and have no counterpart yet."""

    Unknown = 0
    XGMI = 1
    RDMA = 2
    TCP = 3
    FABRIC = 4


class MemoryLocationType(_PybindStyle):
    Unknown = 0
    CPU = 1
    GPU = 2


class PollCqMode(_PybindStyle):
    """Accepted for compatibility: completions always come from the event loop's reader
    on the completion channel, which is what MoRI-IO's EVENT mode intends."""

    POLLING = 0
    EVENT = 1


_LEVELS = {
    "trace": logging.DEBUG,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
    "off": logging.CRITICAL + 10,
}


def set_log_level(level: str) -> None:
    """Set the level of the ``moriio_async`` logger by MoRI-IO's level names."""
    try:
        logging.getLogger("moriio_async").setLevel(_LEVELS[str(level).lower()])
    except KeyError:
        raise ValueError(f"unknown log level {level!r}: choose one of {sorted(_LEVELS)}") from None
