"""MoRI-IO's Python API (``mori.io``) on moriio_async: synchronous, safe from any thread.

Port MoRI-IO code by changing its imports::

    from moriio_async.compat.mori import (
        IOEngine, IOEngineConfig, BackendType, RdmaBackendConfig, StatusCode, TransferStatus,
    )

    engine = IOEngine("initiator", IOEngineConfig(host="127.0.0.1", port=0))   # ready on return
    engine.create_backend(BackendType.RDMA, RdmaBackendConfig(qp_per_transfer=2))
    engine.register_remote_engine(peer_desc)                # an EngineDesc, e.g. EngineDesc.unpack(bytes)
    mem = engine.register_torch_tensor(buffer)              # CPU tensor, numpy array, or register_memory(ptr, ...)
    session = engine.create_session(mem, remote_mem)
    status = session.batch_read(offsets, offsets, sizes, session.allocate_transfer_uid())
    status.Wait()                                           # blocks with the GIL released

Each engine runs a moriio_async ``IOEngine`` on an event loop thread of its own
(``IOEngine.aio``, ``IOEngine.loop``); completions come from that loop's
completion reader. What differs from MoRI-IO is listed in each module's
docstring: ``config`` (which ``RdmaBackendConfig`` fields are honoured),
``plan`` and ``session`` (striping, target-side status), ``runtime`` (what
the moriio_async engine provides: uids, inbound statuses, ``alive``,
``deregister_remote_engine``), ``fabric`` (fabric memory: host memory only).
"""

from __future__ import annotations

from .config import FabricBackendConfig, IOEngineConfig, RdmaBackendConfig, XgmiBackendConfig
from .desc import EngineDesc, MemoryDesc
from .engine import IOEngine
from .enums import BackendType, MemoryLocationType, PollCqMode, StatusCode, set_log_level
from .fabric import (
    TORCH_DEVICE_TYPE_MAP,
    FabricUnsupported,
    fabric_alloc,
    fabric_free,
    fabric_mem_pool,
    fabric_torch_allocator,
    make_fabric_mem_pool,
    use_fabric_torch_allocator,
)
from .session import IOEngineSession
from .status import TransferStatus, wait_all

__all__ = [
    "TORCH_DEVICE_TYPE_MAP",
    "BackendType",
    "EngineDesc",
    "FabricBackendConfig",
    "FabricUnsupported",
    "IOEngine",
    "IOEngineConfig",
    "IOEngineSession",
    "MemoryDesc",
    "MemoryLocationType",
    "PollCqMode",
    "RdmaBackendConfig",
    "StatusCode",
    "TransferStatus",
    "XgmiBackendConfig",
    "fabric_alloc",
    "fabric_free",
    "fabric_mem_pool",
    "fabric_torch_allocator",
    "make_fabric_mem_pool",
    "set_log_level",
    "use_fabric_torch_allocator",
    "wait_all",
]
