"""``MoRIIOWrapper`` (threads, over :mod:`moriio_async.compat.mori`) and ``AsyncMoRIIOWrapper`` (a loop)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, Generic, TypeVar

from moriio_async import IOEngine as AsyncEngine
from moriio_async import Session as AsyncSession
from moriio_async import Transfer
from moriio_async import TransferError as AsyncTransferError
from moriio_async import waiting_for_transfer_complete as async_wait

from ..mori import (
    BackendType,
    EngineDesc,
    IOEngine,
    IOEngineSession,
    MemoryDesc,
    PollCqMode,
    RdmaBackendConfig,
    TransferStatus,
)
from .common import MoRIIOConstants, MoRIIOError, failed_line, timed_out_line, transfer_error

__all__ = ["AsyncMoRIIOWrapper", "MoRIIOWrapper"]

T = TypeVar("T")


class _Pending(Generic[T]):
    """Transfers a wrapper started and no wait has taken yet (``waiting_for_transfer_complete(None)``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.transfer_status: list[T] = []

    def started(self, item: T) -> T:
        with self.lock:
            self.transfer_status.append(item)
        return item

    def take(self, items: Iterable[T] | None) -> list[T]:
        with self.lock:
            if items is None:
                taken, self.transfer_status = self.transfer_status, []
                return taken
            taken = list(items)
            ids = {id(t) for t in taken}
            self.transfer_status = [t for t in self.transfer_status if id(t) not in ids]
            return taken


class MoRIIOWrapper(_Pending[TransferStatus]):
    """vLLM's ``MoRIIOWrapper`` over a compat engine; every method is safe from any thread."""

    def __init__(
        self,
        moriio_engine: IOEngine | None = None,
        tp_rank: int = 0,
        dp_rank: int = 0,
        transfer_timeout: float = MoRIIOConstants.DEFAULT_TRANSFER_TIMEOUT,
    ) -> None:
        super().__init__()
        self.tp_rank = tp_rank
        self.dp_rank = dp_rank
        self.moriio_engine = moriio_engine
        self.local_memory_registered = False
        self.local_memory_metadata: MemoryDesc | None = None
        self.remote_engine_ip: str | None = None
        self.sessions: list[IOEngineSession] = []
        self._transfer_timeout = transfer_timeout

    def set_moriio_engine(self, moriio_engine: IOEngine) -> None:
        if moriio_engine is None:
            raise MoRIIOError("You Cannot pass None engine to MoRIIOWrapper!")
        self.moriio_engine = moriio_engine

    @property
    def engine(self) -> IOEngine:
        if self.moriio_engine is None:
            raise MoRIIOError("MoRIIO engine must be set first")
        return self.moriio_engine

    def set_backend_type(
        self, backend_type: BackendType, qp_per_transfer: int = 1, post_batch_size: int = -1, num_workers: int = 1
    ) -> None:
        """vLLM's RDMA settings: notifications off (vLLM signals completion over its own channel)."""
        config = RdmaBackendConfig(
            qp_per_transfer, post_batch_size, num_workers, PollCqMode.POLLING, enable_notification=False
        )
        self.engine.create_backend(backend_type, config)

    def get_agent_metadata(self) -> bytes:
        return self.engine.get_engine_desc().pack()

    def register_remote_engine(self, remote_packed_engine_metadata: bytes) -> str:
        desc = EngineDesc.unpack(remote_packed_engine_metadata)
        self.engine.register_remote_engine(desc)
        return desc.key

    def register_local_tensor(self, tensor: Any) -> bytes:
        """Register a CPU tensor (or any writable buffer); returns its packed ``MemoryDesc``."""
        try:
            self.local_memory_metadata = self.engine.register_torch_tensor(tensor)
            packed = self.local_memory_metadata.pack()
        except Exception as e:
            raise MoRIIOError(f"Failed to register local memory: {e}") from e
        self.local_memory_registered = True
        return packed

    def get_unpack_memory_metadata(self, packed_memory_metadata: bytes) -> MemoryDesc:
        return MemoryDesc.unpack(packed_memory_metadata)

    def build_session(self, local_memory_metadata: MemoryDesc, remote_memory_metadata: MemoryDesc) -> IOEngineSession:
        session = self.engine.create_session(local_memory_metadata, remote_memory_metadata)
        if session is None:
            raise MoRIIOError("create_session returned None: create the backend and register the remote engine first")
        return session

    def _ready(self) -> IOEngine:
        if not self.local_memory_registered:
            raise MoRIIOError("You have not register local memory data!")
        return self.engine

    def read_remote_data(
        self,
        transfer_size_byte: Sequence[int],
        local_offset: Sequence[int] = (0,),
        remote_offset: Sequence[int] = (0,),
        session: IOEngineSession | None = None,
    ) -> TransferStatus:
        """One ``batch_read`` on ``session``; the status is also kept for ``waiting_for_transfer_complete()``."""
        engine = self._ready()
        if session is None:
            raise MoRIIOError("read_remote_data needs a session")
        uid = engine.allocate_transfer_uid()
        return self.started(session.batch_read(local_offset, remote_offset, transfer_size_byte, uid))

    def write_remote_data(
        self,
        transfer_size_byte: Sequence[int],
        local_offset: Sequence[int] = (0,),
        remote_offset: Sequence[int] = (0,),
        session: IOEngineSession | None = None,
    ) -> TransferStatus:
        engine = self._ready()
        if session is None:
            raise MoRIIOError("write_remote_data needs a session")
        uid = engine.allocate_transfer_uid()
        return self.started(session.batch_write(local_offset, remote_offset, transfer_size_byte, uid))

    def write_remote_data_single(
        self, transfer_size_byte: int, local_offset: int = 0, remote_offset: int = 0, sess_idx: int = 0
    ) -> TransferStatus:
        engine = self._ready()
        status = self.sessions[sess_idx].write(
            local_offset, remote_offset, transfer_size_byte, engine.allocate_transfer_uid()
        )
        return self.started(status)

    def waiting_for_transfer_complete(self, transfer_statuses: Iterable[TransferStatus] | None = None) -> None:
        """Block (GIL released) until every status ended; ``TransferError`` lists the failed and timed out.

        With no list: this wrapper's transfers that no call has waited for yet.
        """
        statuses = self.take(transfer_statuses)
        if not statuses:
            return
        timeout = self._transfer_timeout
        deadline = time.monotonic() + timeout
        for status in statuses:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            status.WaitFor(max(1, int(left * 1000)))
        lines = []
        for status in statuses:
            if status.Failed():
                lines.append(failed_line(status.Message(), status.Code()))
            elif not status.Succeeded():
                lines.append(timed_out_line(timeout))
        if lines:
            raise transfer_error(lines, len(statuses))


class AsyncMoRIIOWrapper(_Pending[Transfer]):
    """The wrapper's surface over the asyncio API (call it from the engine's loop).

    The transfer calls return ``moriio_async.Transfer`` objects (awaitable, with the
    same status methods); the wait is a coroutine. Empty batches keep the async
    API's stricter checks (``InvalidArgument``). They pass no transfer uid: a uid
    is what makes the engine announce a transfer to its target, and vLLM turns
    MoRI-IO's notifications off (``set_backend_type``), signalling over its own
    channel instead.
    """

    def __init__(
        self,
        moriio_engine: AsyncEngine,
        tp_rank: int = 0,
        dp_rank: int = 0,
        transfer_timeout: float = MoRIIOConstants.DEFAULT_TRANSFER_TIMEOUT,
    ) -> None:
        super().__init__()
        self.moriio_engine = moriio_engine
        self.tp_rank = tp_rank
        self.dp_rank = dp_rank
        self.sessions: list[AsyncSession] = []
        self._transfer_timeout = transfer_timeout

    async def build_session(self, local_memory: Any, remote_memory: Any) -> AsyncSession:
        return await self.moriio_engine.create_session(local_memory, remote_memory)

    def read_remote_data(
        self,
        transfer_size_byte: Sequence[int],
        local_offset: Sequence[int],
        remote_offset: Sequence[int],
        session: AsyncSession,
    ) -> Transfer:
        return self.started(session.batch_read(local_offset, remote_offset, transfer_size_byte))

    def write_remote_data(
        self,
        transfer_size_byte: Sequence[int],
        local_offset: Sequence[int],
        remote_offset: Sequence[int],
        session: AsyncSession,
    ) -> Transfer:
        return self.started(session.batch_write(local_offset, remote_offset, transfer_size_byte))

    def write_remote_data_single(
        self, transfer_size_byte: int, local_offset: int = 0, remote_offset: int = 0, sess_idx: int = 0
    ) -> Transfer:
        return self.started(self.sessions[sess_idx].write(local_offset, remote_offset, transfer_size_byte))

    async def waiting_for_transfer_complete(self, transfer_statuses: Iterable[Transfer] | None = None) -> None:
        """Wait on the loop (no thread blocks); raises vLLM's ``TransferError`` with vLLM's lines."""
        transfers = self.take(transfer_statuses)
        if not transfers:
            return
        timeout = self._transfer_timeout
        try:
            await async_wait(transfers, timeout)
        except AsyncTransferError:
            lines = [
                failed_line(t.Message(), t.Code()) if t.Failed() else timed_out_line(timeout)
                for t in transfers
                if not t.Succeeded()
            ]
            raise transfer_error(lines, len(transfers)) from None
