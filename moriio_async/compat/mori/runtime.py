"""``EngineRuntime``: what a compat engine and its sessions share.

It owns the loop thread, the moriio_async ``IOEngine`` running on it, the
tables callers read from other threads (remote engines, backends) and the
ones only the loop thread touches (local regions, cached engine-level
sessions). It holds no reference to the ``IOEngine`` facade, so the facade can
be collected and its finalizer close the runtime.

Uids, target-side statuses, ``alive`` and ``deregister_remote_engine`` are
the engine's own (``IOEngine.allocate_transfer_uid``, ``announce_transfer``,
``pop_inbound_transfer_status``, ``Session.alive``,
``deregister_remote_engine``). A MoRI-IO status may span several engine
transfers (its stripes), and MoRI-IO lets a caller reuse a uid, so a status
is announced once, with ``announce_transfer``, when all its parts have ended,
instead of handing its uid to each part.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any

from moriio_async import IOEngine as AsyncEngine
from moriio_async import IOEngineConfig as AsyncEngineConfig
from moriio_async import MoriioError
from moriio_async import StatusCode as AsyncStatusCode

from .config import IOEngineConfig, RdmaBackendConfig
from .desc import IPC_HANDLE_SIZE, EngineDesc, MemoryDesc
from .enums import BackendType, MemoryLocationType, StatusCode
from .loop import LoopThread
from .session import IOEngineSession
from .status import TransferStatus
from .trace import TransferTrace

__all__ = ["NO_BACKEND", "EngineRuntime", "LocalRegion", "Pair", "PairCallback", "backend_name_for"]

log = logging.getLogger("moriio_async")

NO_BACKEND = "No available backend found, create backend first"
"""MoRI-IO's message when no backend can reach the remote engine (none created, or the engine is unknown)."""


def backend_name_for(kind: BackendType) -> str:
    """The moriio_async backend behind a MoRI-IO backend type."""
    if kind is BackendType.RDMA:
        # cma for peers on this host, verbs when a device works, else tcp (each session the best its peer
        # shares; see docs/backends.md, "A transport per peer"); MORIIO_COMPAT_RDMA_BACKEND=verbs refuses to fall back
        return os.environ.get("MORIIO_COMPAT_RDMA_BACKEND", "auto")
    if kind is BackendType.TCP:
        return "tcp"
    raise NotImplementedError(
        f"{kind} moves GPU memory; moriio_async has no GPU backend yet: use BackendType.RDMA or BackendType.TCP"
    )


PairCallback = Callable[[IOEngineSession | None, BaseException | None], None]


class Pair:
    """A cached engine-level session being opened or open, and the calls waiting for it, in order."""

    def __init__(self, task: asyncio.Task[IOEngineSession | None]) -> None:
        self.task = task
        self.waiting: deque[PairCallback] = deque()
        task.add_done_callback(self._drain)

    def outcome(self) -> tuple[IOEngineSession | None, BaseException | None]:
        if self.task.cancelled():
            return None, asyncio.CancelledError("opening the session was cancelled")
        error = self.task.exception()
        return (None, error) if error is not None else (self.task.result(), None)

    def _drain(self, _: object) -> None:
        session, error = self.outcome()
        while self.waiting:
            self.waiting.popleft()(session, error)


@dataclass(frozen=True, slots=True)
class LocalRegion:
    desc: MemoryDesc
    keep: object  # the buffer (and the tensor behind it) stays alive while registered


class EngineRuntime:
    """The loop thread, the engine on it, and the tables around it."""

    def __init__(self, key: str, config: IOEngineConfig) -> None:
        self.key = key
        self.explicit = config.options is not None
        base = config.options
        if base is None:
            base = AsyncEngineConfig(backend=backend_name_for(BackendType.RDMA))
        self.options = replace(base, host=config.host or "127.0.0.1", port=config.port)
        self.rdma = RdmaBackendConfig().effective()
        self.closed = False
        self.remotes: dict[str, EngineDesc] = {}
        self.backends: dict[BackendType, RdmaBackendConfig] = {}
        self.locals: dict[int, LocalRegion] = {}  # loop thread only
        self.pairs: dict[tuple[int, str, int, int], Pair] = {}  # loop thread only
        self.sessions: weakref.WeakSet[IOEngineSession] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._mem_ids = itertools.count(0)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._open_lock: asyncio.Lock | None = None
        self.trace = TransferTrace.from_env(key)  # MORIIO_ASYNC_TRACE: a line per ended status, off by default
        self.loop = LoopThread(f"moriio-compat-{key}")
        try:
            self.aio: AsyncEngine = self.loop.run(self._start(self.options), "IOEngine()")
        except BaseException:
            self.loop.stop()
            raise

    # -- life cycle ------------------------------------------------------------------------------

    async def _start(self, options: AsyncEngineConfig) -> AsyncEngine:
        engine = AsyncEngine(self.key, options)
        await engine.start()
        return engine

    def _spawn(self, coro: Coroutine[Any, Any, object]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _stop_engine(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.aio.close()
        if self.trace is not None:
            self.trace.close()

    def close(self) -> None:
        """Close the engine and stop the loop thread. Idempotent; from the loop thread it only schedules it."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        if not self.loop.running:
            return
        if self.loop.in_loop_thread:

            async def close_then_stop() -> None:
                await self._stop_engine()
                self.loop.stop()

            self.loop.loop.create_task(close_then_stop())
            return
        try:
            self.loop.run(self._stop_engine(), "IOEngine.close", timeout=60)
        finally:
            self.loop.stop()

    def problem(self, remote_key: str | None = None) -> str | None:
        """Why a transfer cannot start now (MoRI-IO reports these as ERR_BAD_STATE), or None."""
        if self.closed:
            return f"engine {self.key!r} is closed"
        with self._lock:
            if not self.backends or (remote_key is not None and remote_key not in self.remotes):
                return NO_BACKEND
        return None

    def new_status(self) -> TransferStatus:
        return TransferStatus(loop_guard=self.loop.forbid_blocking)

    def allocate_transfer_uid(self) -> int:
        return self.aio.allocate_transfer_uid()  # thread-safe

    # -- backends --------------------------------------------------------------------------------

    def create_backend(self, kind: BackendType, config: RdmaBackendConfig) -> None:
        cfg = config.effective()
        name = self.options.backend if self.explicit else backend_name_for(kind)
        with self._lock:
            if kind in self.backends:
                log.warning("Backend type %s already exists, skip duplicate creation", kind)
                return
        wanted = cfg.engine_options(replace(self.options, backend=name))
        running = self.aio.config
        restart = (
            (name != "auto" and (name,) != self.aio.transports and not wanted.backends)
            or wanted.transport_names() != running.transport_names()
            or wanted.sq_depth != running.sq_depth
            or wanted.max_sge != running.max_sge
        )
        if restart and self._pristine():
            self.loop.run(self._restart(wanted), "create_backend")
        elif restart:
            log.warning(
                "create_backend(%s) after memory, sessions or remote engines were registered: keeping backend %s "
                "(sq_depth %d, max_sge %d); create backends first to change them",
                kind, self.aio.backend_name, running.sq_depth, running.max_sge,
            )  # fmt: skip
        with self._lock:
            self.backends[kind] = cfg
            self.rdma = cfg
        log.info("Create backend type %s (moriio_async backend %s)", kind, self.aio.backend_name)

    def remove_backend(self, kind: BackendType) -> None:
        with self._lock:
            self.backends.pop(kind, None)

    def _pristine(self) -> bool:
        return not self.loop.call(len, self.locals) and not self.remotes and not len(self.sessions)

    async def _restart(self, options: AsyncEngineConfig) -> None:
        await self._stop_engine()
        self.options = options
        self.aio = await self._start(options)

    # -- memory ----------------------------------------------------------------------------------

    def register(self, buffer: object, device_id: int, keep: object) -> MemoryDesc:
        """Register a writable buffer (on the loop thread) and describe it with MoRI-IO's fields."""
        if self.closed:
            raise RuntimeError(f"engine {self.key!r} is closed")
        return self.loop.call(self._register, buffer, device_id, keep)

    def _register(self, buffer: object, device_id: int, keep: object) -> MemoryDesc:
        inner = self.aio.register_memory(buffer, export=True)  # MoRI-IO: a peer given the packed desc reaches it
        desc = MemoryDesc(
            inner=inner, id=next(self._mem_ids) & 0xFFFFFFFF, device_id=device_id, device_bus_id="",
            loc=MemoryLocationType.CPU, ipc_handle=bytes(IPC_HANDLE_SIZE), numa_node=-1,
        )  # fmt: skip
        self.locals[desc.id] = LocalRegion(desc, (buffer, keep))
        return desc

    async def deregister(self, desc: MemoryDesc, timeout: float) -> None:
        """Forget cached sessions on the region, then deregister once no transfer uses it."""
        region = self.locals.get(desc.id)
        if region is None or region.desc != desc:
            return  # MoRI-IO ignores an unknown descriptor
        for key in [k for k in self.pairs if k[0] == desc.id]:
            self._drop_pair(key)
        del self.locals[desc.id]
        await self.aio.release_memory(region.desc.inner, timeout)

    # -- remote engines and sessions -------------------------------------------------------------

    def register_remote_engine(self, desc: EngineDesc) -> None:
        with self._lock:
            self.remotes[desc.key] = desc
        self.loop.call(self.aio.register_remote_engine, desc.inner)

    def deregister_remote_engine(self, desc: EngineDesc) -> None:
        """Forget ``desc``'s engine; transfers already accepted end as they would (see ``_drop_pair``)."""
        with self._lock:
            self.remotes.pop(desc.key, None)

        def drop() -> None:
            opening = []
            for key in [k for k in self.pairs if k[1] == desc.key]:
                if not self.pairs[key].task.done():
                    opening.append(self.pairs[key].task)
                self._drop_pair(key)
            if opening:  # calls made before this one still open their session: forget the peer after them
                self._spawn(self._forget_after(desc.key, opening))
            else:
                self._forget(desc.key)

        if self.loop.running:
            self.loop.call(drop)

    async def _forget_after(self, key: str, opening: list[asyncio.Task[IOEngineSession | None]]) -> None:
        await asyncio.wait(opening)
        self._forget(key)

    def _forget(self, key: str) -> None:
        with self._lock:
            if key in self.remotes:
                return  # registered again meanwhile
        with contextlib.suppress(MoriioError):  # a closed engine has nothing to forget
            self.aio.deregister_remote_engine(key)

    async def open_session(
        self, local: MemoryDesc, remote: MemoryDesc, owner: object = None, *, accepted: bool = False
    ) -> IOEngineSession | None:
        """A striped session, or None where MoRI-IO has none (no backend, remote engine not registered).

        ``accepted``: for transfer calls that were checked when made; a deregistration since then does not
        stop them (in MoRI-IO the call builds its connection before it returns).
        """
        if self.problem(None if accepted else remote.engine_key) is not None:
            return None
        region = self.locals.get(local.id)
        if region is None or region.desc != local:
            raise RuntimeError(f"create_session: {local!r} is not a live registration of engine {self.key!r}")
        if self._open_lock is None:
            self._open_lock = asyncio.Lock()
        cfg = self.rdma
        stripes = []
        # One at a time: the first dials the peer's control link, the others reuse it.
        async with self._open_lock:
            try:
                for _ in range(cfg.qp_per_transfer):
                    stripes.append(await self.aio.create_session(region.desc.inner, remote.inner))
            except (MoriioError, OSError) as exc:
                for stripe in stripes:
                    await stripe.close()
                raise RuntimeError(f"create_session to engine {remote.engine_key!r} failed: {exc}") from exc
        session = IOEngineSession(self, local, remote, stripes, cfg, owner)
        self.sessions.add(session)
        return session

    def with_pair(self, local: MemoryDesc, remote: MemoryDesc, then: PairCallback) -> None:
        """Loop thread: call ``then(session, error)`` with the pair's cached session, opening it if needed.

        Calls for one pair run in the order they were made, also while the session is being opened.
        """
        key = (local.id, remote.engine_key, remote.id, remote.incarnation)
        pair = self.pairs.get(key)
        if pair is not None and pair.task.done() and not pair.waiting:
            session, error = pair.outcome()
            if error is None and session is not None and session.alive():
                then(session, None)
                return
            self._drop_pair(key)
            pair = None
        if pair is None:
            pair = self.pairs[key] = Pair(self.loop.loop.create_task(self.open_session(local, remote, accepted=True)))
        pair.waiting.append(then)

    def _drop_pair(self, key: tuple[int, str, int, int]) -> None:
        """Stop using a cached session; it closes once what it carries has ended (nothing in flight is aborted,
        unless it is still running after ``transfer_timeout``)."""
        pair = self.pairs.pop(key)
        timeout = self.options.transfer_timeout

        def close(_: object) -> None:
            session, _error = pair.outcome()
            if session is not None and not session.closed:
                self._spawn(session.aclose(drain_timeout=timeout))

        pair.task.add_done_callback(close)

    # -- target-side status --------------------------------------------------------------------

    def announce(self, peer: str, uid: int, code: StatusCode) -> None:
        """Loop thread: tell ``peer`` that the status for ``uid`` ended with ``code`` (its ``done`` notice)."""
        if self.closed:
            return
        try:
            self.aio.announce_transfer(peer, uid, AsyncStatusCode(int(code)))
        except MoriioError as exc:
            log.debug("inbound status of uid %d not sent to %s: %s", uid, peer, exc)
