"""moriio_async: asyncio-native one-sided RDMA transfers for KV-cache movement.

MoRI-IO's vocabulary, with ``await``::

    async with IOEngine("decode-0", IOEngineConfig(backend="tcp")) as engine:
        peer = await engine.connect("10.0.0.2:5555")
        local = engine.register_memory(kv_buffer, name="kv")
        session = await engine.create_session(local, peer.memory["kv"])
        t = session.batch_read(local_offsets, remote_offsets, sizes)
        await waiting_for_transfer_complete([t], timeout=30)
"""

from __future__ import annotations

from .aio.transfer import Transfer
from .aio.wait import waiting_for_transfer_complete
from .backends.options import CmaOptions, MockOptions, TcpOptions, VerbsOptions
from .descriptors import EngineDesc, MemoryDesc, TransportDesc
from .engine import EngineStatistics, IOEngine, IOEngineConfig, Notification, PeerInfo, Session, SessionStatistics
from .errors import (
    AuthenticationError,
    BackendUnavailable,
    ControlPlaneError,
    EngineClosed,
    InvalidArgument,
    MemoryInUse,
    MoriioError,
    PeerError,
    SessionClosed,
    StalePeer,
    TransferError,
    TransferFailed,
    TransferTimeout,
)
from .status import Access, StatusCode, WcStatus

TransferStatus = Transfer
"""MoRI-IO's name for what a transfer call returns."""

__version__ = "0.1.0"

__all__ = [
    "Access",
    "AuthenticationError",
    "BackendUnavailable",
    "CmaOptions",
    "ControlPlaneError",
    "EngineClosed",
    "EngineDesc",
    "EngineStatistics",
    "IOEngine",
    "IOEngineConfig",
    "InvalidArgument",
    "MemoryDesc",
    "MemoryInUse",
    "MockOptions",
    "MoriioError",
    "Notification",
    "PeerError",
    "PeerInfo",
    "Session",
    "SessionClosed",
    "SessionStatistics",
    "StalePeer",
    "StatusCode",
    "TcpOptions",
    "Transfer",
    "TransferError",
    "TransferFailed",
    "TransferStatus",
    "TransferTimeout",
    "TransportDesc",
    "VerbsOptions",
    "WcStatus",
    "waiting_for_transfer_complete",
]
