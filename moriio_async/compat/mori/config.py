"""MoRI-IO's configuration objects: ``IOEngineConfig`` and the backend configs.

Like MoRI-IO's (pybind11 ``def_readwrite``) they are plain mutable objects:
MoRI-style code changes ``config.port`` between two engines, and that works.

``RdmaBackendConfig`` keeps MoRI-IO's fields, order and defaults. What each does here:

=========================  =========  ===========================================================
field                      default    here
=========================  =========  ===========================================================
qp_per_transfer            1          honoured: a session holds that many queue pairs and one
                                      batch is striped over them (see ``IOEngineSession``)
post_batch_size            -1         honoured: the merged requests are posted in chunks of this
                                      many, each chunk its own post (-1: one chunk per queue pair)
num_worker_threads         -1         accepted, ignored: posting never blocks, and completions
                                      come from the event loop's reader
poll_cq_mode               POLLING    accepted, ignored: completions are event-driven always
enable_notification        True       honoured: the target learns how each posted transfer
                                      ended (``pop_inbound_transfer_status``; the engine's
                                      ``done`` notice, bounded by ``max_inbound_statuses``)
notif_per_qp               1024       validated (>= 1 with notifications), else ignored: no
                                      receive buffers are pre-posted
enable_transfer_chunking   False      accepted, ignored: the engine splits requests above
chunk_bytes                65536      ``moriio_async.IOEngineConfig.max_wr_bytes`` instead
max_chunks_per_transfer    64         validated (>= 1), else ignored
num_nics_per_transfer      1          accepted, ignored: one device per engine
max_send_wr                0          honoured when > 0: the send-queue depth per queue pair
max_cqe_num                0          accepted, ignored: the completion queue is sized from it
max_msg_sge                0          honoured when > 0: scatter-gather entries per request
=========================  =========  ===========================================================

``max_send_wr`` and ``max_msg_sge`` take effect when ``create_backend`` comes
before memory is registered (MoRI-IO's order); later, they are logged and ignored.
MoRI-IO's environment overrides ``MORI_IO_QP_PER_TRANSFER``,
``MORI_IO_POST_BATCH_SIZE`` and ``MORI_IO_ENABLE_NOTIFICATION`` apply too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from moriio_async import IOEngineConfig as AsyncEngineConfig

from .enums import BackendType, PollCqMode

__all__ = ["FabricBackendConfig", "IOEngineConfig", "RdmaBackendConfig", "XgmiBackendConfig"]


class IOEngineConfig:
    """Where an engine's control plane listens: ``IOEngineConfig(host="", port=0)``.

    ``host=""`` means 127.0.0.1 (a peer must be able to dial the address it is
    given); ``port=0`` picks a free port, read back from ``get_engine_desc().port``.
    ``options``, not in MoRI-IO, is a ``moriio_async.IOEngineConfig`` for the
    engine inside (timeouts, backend, its options); host and port override
    its own. With ``options`` its backend is used whatever ``create_backend`` names.
    """

    def __init__(self, host: str = "", port: int = 0, *, options: AsyncEngineConfig | None = None) -> None:
        self.host = host
        self.port = port
        self.options = options

    def __repr__(self) -> str:
        return f"IOEngineConfig(host={self.host!r}, port={self.port})"


@dataclass(slots=True)
class RdmaBackendConfig:
    """MoRI-IO's RDMA backend configuration (the module docstring says what each field does here)."""

    qp_per_transfer: int = 1
    post_batch_size: int = -1
    num_worker_threads: int = -1
    poll_cq_mode: PollCqMode = PollCqMode.POLLING
    enable_notification: bool = True
    notif_per_qp: int = 1024
    enable_transfer_chunking: bool = False
    chunk_bytes: int = 65536
    max_chunks_per_transfer: int = 64
    num_nics_per_transfer: int = 1
    max_send_wr: int = 0
    max_cqe_num: int = 0
    max_msg_sge: int = 0

    def Type(self) -> BackendType:
        return BackendType.RDMA

    def effective(self) -> RdmaBackendConfig:
        """This config after MoRI-IO's environment overrides, checked as MoRI-IO checks it."""
        cfg = replace(self)
        env = os.environ
        if "MORI_IO_QP_PER_TRANSFER" in env:
            cfg.qp_per_transfer = int(env["MORI_IO_QP_PER_TRANSFER"])
        if "MORI_IO_POST_BATCH_SIZE" in env:
            cfg.post_batch_size = int(env["MORI_IO_POST_BATCH_SIZE"])
        if "MORI_IO_ENABLE_NOTIFICATION" in env:
            cfg.enable_notification = env["MORI_IO_ENABLE_NOTIFICATION"].strip().lower() in ("1", "true", "on", "yes")
        if cfg.qp_per_transfer < 1:
            raise RuntimeError(f"Invalid RDMA config: qp_per_transfer must be >= 1; got {cfg.qp_per_transfer}")
        if cfg.enable_notification and cfg.notif_per_qp == 0:
            raise RuntimeError("Invalid RDMA config: notifPerQp must be >= 1 when notification is enabled")
        if cfg.max_chunks_per_transfer < 1:
            raise RuntimeError(
                f"Invalid RDMA config: maxChunksPerTransfer must be >= 1; got {cfg.max_chunks_per_transfer}"
            )
        return cfg

    def engine_options(self, base: AsyncEngineConfig) -> AsyncEngineConfig:
        """``base`` with the fields this config honours at the engine level."""
        return replace(
            base,
            sq_depth=self.max_send_wr if self.max_send_wr > 0 else base.sq_depth,
            max_sge=self.max_msg_sge if self.max_msg_sge > 0 else base.max_sge,
        )


@dataclass(slots=True)
class _GpuBackendConfig:
    """MoRI-IO's settings of a GPU backend (XGMI, FABRIC): accepted so MoRI-style imports work;
    ``create_backend`` refuses them (no GPU backend)."""

    num_streams: int = 64
    num_events: int = 64


@dataclass(slots=True)
class XgmiBackendConfig(_GpuBackendConfig):
    def Type(self) -> BackendType:
        return BackendType.XGMI


@dataclass(slots=True)
class FabricBackendConfig(_GpuBackendConfig):
    def Type(self) -> BackendType:
        return BackendType.FABRIC
