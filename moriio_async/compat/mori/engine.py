"""``IOEngine``: MoRI-IO's engine, synchronous and safe to call from any thread.

It runs a moriio_async ``IOEngine`` on a loop thread of its own (uvloop when
installed), ready when the constructor returns. Transfer calls check their
input in the calling thread, hand the work to the loop with
``call_soon_threadsafe`` and return a ``TransferStatus`` at once; every
completion comes from that loop's completion reader. Calls that must wait for
the loop (``create_session``, ``deregister_memory``, ``Wait``...) raise a
clear error when made from the loop's own thread instead of deadlocking.
"""

from __future__ import annotations

import asyncio
import ctypes
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

from moriio_async import IOEngine as AsyncEngine

from .config import FabricBackendConfig, IOEngineConfig, RdmaBackendConfig, XgmiBackendConfig
from .desc import EngineDesc, MemoryDesc
from .enums import BackendType, MemoryLocationType, StatusCode
from .fabric import fabric_allocation
from .loop import close_before_exit
from .plan import check_blocks
from .runtime import NO_BACKEND, EngineRuntime, backend_name_for
from .session import IOEngineSession
from .status import TransferStatus, wait_all

__all__ = ["IOEngine"]


class IOEngine:
    """MoRI-IO's ``IOEngine(key, config)``; see the module docstring for the threading model."""

    def __init__(self, key: str, config: IOEngineConfig | None = None) -> None:
        self._rt = EngineRuntime(key, config or IOEngineConfig())
        self._finalizer = weakref.finalize(self, self._rt.close)
        close_before_exit(self._finalizer)

    # -- extras (not in MoRI-IO) -----------------------------------------------------------------

    @property
    def key(self) -> str:
        return self._rt.key

    @property
    def aio(self) -> AsyncEngine:
        """The moriio_async engine underneath; use it only from code running on ``loop``."""
        return self._rt.aio

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The engine's event loop (running on its own thread)."""
        return self._rt.loop.loop

    def close(self) -> None:
        """Close the engine and stop its loop thread (also done when the engine is collected, or at exit)."""
        self._finalizer()

    def __enter__(self) -> IOEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def notify(self, peer_key: str, data: bytes) -> None:
        """Send a small message to a registered peer engine; it arrives after data this engine saw complete."""
        self._rt.loop.run(self._rt.aio.notify(peer_key, bytes(data)), "IOEngine.notify")

    def recv_notification(self, timeout: float | None = None) -> tuple[str, bytes]:
        """The next (peer key, data) notification; ``TimeoutError`` after ``timeout`` seconds."""
        note = self._rt.loop.run(self._rt.aio.recv_notification(timeout), "IOEngine.recv_notification")
        return note.peer, note.data

    # -- MoRI-IO -----------------------------------------------------------------------------------

    def get_engine_desc(self) -> EngineDesc:
        return EngineDesc.of(self._rt.loop.call(self._rt.aio.get_engine_desc))

    def create_backend(
        self,
        type: BackendType,
        config: RdmaBackendConfig | XgmiBackendConfig | FabricBackendConfig | None = None,
    ) -> None:
        """Enable a backend. RDMA is the verbs backend (TCP where no RDMA device works); TCP is TCP."""
        kind = BackendType(type)
        backend_name_for(kind)  # XGMI / FABRIC: NotImplementedError saying why
        if config is None:
            config = RdmaBackendConfig()
        if not isinstance(config, RdmaBackendConfig):
            raise TypeError(f"create_backend({kind}) takes an RdmaBackendConfig, not {config.__class__.__name__}")
        self._rt.create_backend(kind, config)

    def remove_backend(self, type: BackendType) -> None:
        self._rt.remove_backend(BackendType(type))

    def register_remote_engine(self, engine_desc: EngineDesc) -> None:
        self._rt.register_remote_engine(engine_desc)

    def deregister_remote_engine(self, engine_desc: EngineDesc) -> None:
        """Forget a peer: new sessions and engine-level transfers to it fail; existing sessions keep working,
        and transfers in flight end as they would."""
        self._rt.deregister_remote_engine(engine_desc)

    def register_memory(self, ptr: int, size: int, device_id: int, mem_loc: MemoryLocationType) -> MemoryDesc:
        """Register ``size`` bytes of host memory at address ``ptr`` (the caller keeps it alive and writable)."""
        if MemoryLocationType(mem_loc) is MemoryLocationType.GPU:
            raise RuntimeError(_NO_GPU)
        if not isinstance(ptr, int) or ptr <= 0 or not isinstance(size, int) or size <= 0:
            raise ValueError(f"register_memory needs a non-null address and a size > 0, not ({ptr!r}, {size!r})")
        buffer = (ctypes.c_char * size).from_address(ptr)
        return self._rt.register(buffer, device_id, fabric_allocation(ptr, size))  # keeps a fabric_alloc mapped

    def register_torch_tensor(self, tensor: Any) -> MemoryDesc:
        """Register a contiguous CPU tensor (torch is not imported: anything shaped like one works).

        Not in MoRI-IO: any writable contiguous buffer (a numpy array) is accepted too.
        """
        if not hasattr(tensor, "data_ptr"):
            return self._rt.register(tensor, -1, tensor)
        if not tensor.is_contiguous():
            raise RuntimeError("input tensor must be contiguous")
        device = tensor.device
        if device.type != "cpu":
            where = device.type if device.index is None else f"{device.type}:{device.index}"
            raise RuntimeError(f"register_torch_tensor: the tensor is on {where}: {_NO_GPU}")
        size = int(tensor.nelement()) * int(tensor.element_size())
        if size <= 0:
            raise ValueError("register_torch_tensor: the tensor is empty")
        buffer = (ctypes.c_char * size).from_address(int(tensor.data_ptr()))
        return self._rt.register(buffer, -1 if device.index is None else int(device.index), tensor)

    def deregister_memory(self, mem_desc: MemoryDesc, timeout: float = 30.0) -> None:
        """Deregister once no transfer uses the region (waits up to ``timeout``; MoRI-IO does not wait)."""
        self._rt.loop.run(self._rt.deregister(mem_desc, timeout), "IOEngine.deregister_memory")

    def allocate_transfer_uid(self) -> int:
        return self._rt.allocate_transfer_uid()

    def create_session(self, local_mem: MemoryDesc, remote_mem: MemoryDesc) -> IOEngineSession | None:
        """A session over ``qp_per_transfer`` queue pairs (blocks while they connect); None without a backend."""
        return self._rt.loop.run(self._rt.open_session(local_mem, remote_mem, self), "IOEngine.create_session")

    def read(
        self,
        local_dest_mem_desc: MemoryDesc,
        local_offset: int,
        remote_src_mem_desc: MemoryDesc,
        remote_offset: int,
        size: int,
        transfer_uid: int | None = None,
    ) -> TransferStatus:
        return self._one(True, local_dest_mem_desc, [local_offset], remote_src_mem_desc, [remote_offset], [size],
                         transfer_uid)  # fmt: skip

    def write(
        self,
        local_src_mem_desc: MemoryDesc,
        local_offset: int,
        remote_dest_mem_desc: MemoryDesc,
        remote_offset: int,
        size: int,
        transfer_uid: int | None = None,
    ) -> TransferStatus:
        return self._one(False, local_src_mem_desc, [local_offset], remote_dest_mem_desc, [remote_offset], [size],
                         transfer_uid)  # fmt: skip

    def batch_read(
        self,
        local_dest_mem_descs: Sequence[MemoryDesc],
        local_offsets: Sequence[Sequence[int]],
        remote_src_mem_descs: Sequence[MemoryDesc],
        remote_offsets: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        transfer_uids: Sequence[int],
    ) -> list[TransferStatus]:
        """One batch per region pair, each with its own status and uid."""
        return self._many(True, local_dest_mem_descs, local_offsets, remote_src_mem_descs, remote_offsets, sizes,
                          transfer_uids)  # fmt: skip

    def batch_write(
        self,
        local_src_mem_descs: Sequence[MemoryDesc],
        local_offsets: Sequence[Sequence[int]],
        remote_dest_mem_descs: Sequence[MemoryDesc],
        remote_offsets: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        transfer_uids: Sequence[int],
    ) -> list[TransferStatus]:
        return self._many(False, local_src_mem_descs, local_offsets, remote_dest_mem_descs, remote_offsets, sizes,
                          transfer_uids)  # fmt: skip

    def pop_inbound_transfer_status(self, remote_key: str, transfer_uid: int) -> TransferStatus | None:
        """Target side: once engine ``remote_key``'s transfer ``transfer_uid`` ended there, a status with its
        code, else None. Returned once (MoRI-IO keeps answering); a failure is reported too (MoRI-IO's
        target never hears of one)."""
        found = self._rt.aio.pop_inbound_transfer_status(remote_key, int(transfer_uid))
        if found is None:
            return None
        code = StatusCode(int(found))
        status = self._rt.new_status()
        message = "" if code is StatusCode.SUCCESS else f"transfer {transfer_uid} failed at engine {remote_key!r}"
        status.Update(code, message)
        return status

    def wait_all(self, statuses: Iterable[TransferStatus | None], timeout_ms: int = -1) -> StatusCode:
        """MoRI-IO's ``WaitAll`` (see ``wait_all``)."""
        return wait_all(statuses, timeout_ms)

    # -- engine-level transfers ------------------------------------------------------------------

    def _many(
        self,
        read: bool,
        locals_: Sequence[MemoryDesc],
        lo: Sequence[Sequence[int]],
        remotes: Sequence[MemoryDesc],
        ro: Sequence[Sequence[int]],
        sz: Sequence[Sequence[int]],
        uids: Sequence[int],
    ) -> list[TransferStatus]:
        if not len(locals_) == len(lo) == len(remotes) == len(ro) == len(sz) == len(uids):
            raise ValueError("batch_read/batch_write: one descriptor, offset list, size list and uid per batch")
        return [
            self._one(read, locals_[i], lo[i], remotes[i], ro[i], sz[i], uids[i], engine_batch=True)
            for i in range(len(sz))
        ]

    def _one(
        self,
        read: bool,
        local: MemoryDesc,
        lo: Sequence[int],
        remote: MemoryDesc,
        ro: Sequence[int],
        sz: Sequence[int],
        uid: int | None,
        engine_batch: bool = False,
    ) -> TransferStatus:
        rt = self._rt
        status = rt.new_status()
        uid = rt.allocate_transfer_uid() if uid is None else int(uid)
        problem = rt.problem(remote.engine_key)
        if problem is not None:
            status.Update(StatusCode.ERR_BAD_STATE, problem)
            return status
        checked = check_blocks(lo, ro, sz, local.size, remote.size)
        if isinstance(checked, str):
            status.Update(StatusCode.ERR_INVALID_ARGS, checked)
            return status
        if engine_batch and not checked[2]:
            status.SetCode(StatusCode.SUCCESS)  # MoRI-IO: an empty engine-level batch succeeds, unannounced
            return status
        status.SetCode(StatusCode.IN_PROGRESS)
        rt.loop.post(self._post, rt, read, local, remote, checked, uid, status)
        return status

    @staticmethod
    def _post(
        rt: EngineRuntime,
        read: bool,
        local: MemoryDesc,
        remote: MemoryDesc,
        blocks: tuple[list[int], list[int], list[int]],
        uid: int,
        status: TransferStatus,
    ) -> None:
        """Loop thread: post on the pair's cached session once it exists; calls keep their order."""

        def then(session: IOEngineSession | None, error: BaseException | None) -> None:
            if error is not None:
                status.Update(StatusCode.ERR_RDMA_OP, str(error))
            elif session is None:
                status.Update(StatusCode.ERR_BAD_STATE, NO_BACKEND)
            else:
                session.post_blocks(read, *blocks, uid, status)

        if rt.closed:
            status.Update(StatusCode.ERR_BAD_STATE, f"engine {rt.key!r} is closed")
            return
        rt.with_pair(local, remote, then)


_NO_GPU = (
    "device memory needs a GPU backend, which moriio_async does not have yet: register host memory "
    "(a CPU tensor or buffer) instead"
)
