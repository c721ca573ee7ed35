"""What a prefill and a decode instance share: the engine, the KV pool, the model thread, peers.

An ``Instance`` owns one ``IOEngine`` with one registered buffer (the pool's
cache array, exported as ``"kv"``), one worker thread for the model (numpy
releases the GIL in its kernels; the event loop never computes), the sessions to
its peers, and the task that routes engine notifications to the role's handlers.

Peers are named by ``EngineRef`` (key, address, incarnation). A peer that
restarted has a new incarnation: the instance connects to it again and makes a
new session, and never talks to the new process through the old handles.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, TypeVarTuple

import msgspec

from moriio_async import (
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    MoriioError,
    PeerInfo,
    Session,
)
from moriio_async.metrics import EngineCollector

from .config import InstanceSettings
from .kvpool import KVPool
from .messages import ControlMessage, EngineRef, InstanceHealth, control_decoder, encode_control
from .metrics import InstanceMetrics, StatsCollector
from .model import Model

__all__ = ["Instance", "PeerUnavailable", "ServingError", "check_prompt"]

log = logging.getLogger("moriio_async.serving")
T = TypeVar("T")
Ts = TypeVarTuple("Ts")
Handler = Callable[[Any, str], Coroutine[Any, Any, None]]


class ServingError(Exception):
    """A request failed; ``status`` is the HTTP answer, ``retryable`` says another instance may succeed."""

    def __init__(self, status: int, message: str, *, retryable: bool = False, cause: str = "") -> None:
        super().__init__(message)
        self.status, self.retryable, self.cause = status, retryable, cause


class PeerUnavailable(ServingError):
    """A peer instance cannot be reached, or it is not the incarnation the request names."""

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(502, message, retryable=True, cause=cause)


class Instance:
    """The engine, KV pool, model thread and peer sessions of one prefill or decode process."""

    def __init__(self, settings: InstanceSettings) -> None:
        self.settings = settings
        self.model = Model(settings.model)
        self.pool = KVPool(self.model.new_cache(settings.num_blocks))
        self.metrics = InstanceMetrics()
        self.engine = IOEngine(
            settings.name,
            IOEngineConfig(
                host=settings.host,
                port=settings.engine_port,
                backend=settings.backend,
                transfer_timeout=settings.transfer_timeout,
                control_timeout=settings.control_timeout,
            ),
        )
        self.handlers: dict[type[Any], Handler] = {}
        self.requests_served = 0
        self.requests_in_flight = 0
        self._kv: MemoryDesc | None = None
        self._model_thread = ThreadPoolExecutor(1, thread_name_prefix=f"{settings.name}-model")
        self._peers: dict[str, PeerInfo] = {}
        self._sessions: dict[str, Session] = {}
        self._peer_locks: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._router: asyncio.Task[None] | None = None

    # -- life cycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        await self.engine.start()
        self._kv = self.engine.register_memory(self.pool.array, name="kv")
        r = self.metrics.registry
        r.register(StatsCollector("moriio_kv_blocks", "KV blocks of this instance by state", self.pool.stats))
        r.register(EngineCollector(self.engine))
        self._router = asyncio.create_task(self._route_notifications(), name=f"{self.settings.name}-notifications")
        log.info(
            "%s: engine %s (%s), %d KV blocks",
            self.settings.name,
            self.engine.address,
            self.backend,
            self.pool.num_blocks,
        )

    async def close(self) -> None:
        if self._router is not None:
            self._router.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, *([self._router] if self._router else []), return_exceptions=True)
        await self.engine.close()
        await asyncio.get_running_loop().run_in_executor(None, self._model_thread.shutdown)

    @property
    def kv(self) -> MemoryDesc:
        if self._kv is None:
            raise RuntimeError("the instance is not started")
        return self._kv

    @property
    def backend(self) -> str:
        """The transports its KV moves over ("cma", or "cma+tcp" with peers on other hosts): its own
        sessions' and those of the peers that opened pairs to it; before any, the engine's preferred
        backend."""
        stats = self.engine.statistics()
        used = sorted({*stats.peer_transports.values(), *stats.answering_transports.values()})
        return "+".join(used) if used else self.engine.backend_name

    def engine_ref(self) -> EngineRef:
        return EngineRef(self.settings.name, self.engine.address, self.engine.incarnation)

    def health(self) -> InstanceHealth:
        s = self.settings
        return InstanceHealth(
            role=s.role,
            name=s.name,
            pid=os.getpid(),
            model=s.model.name,
            fingerprint=s.model.fingerprint(),
            engine=self.engine_ref(),
            backend=self.backend,
            layout=self.pool.layout,
            blocks=self.pool.stats(),
            requests_in_flight=self.requests_in_flight,
            requests_served=self.requests_served,
        )

    def spawn(self, coro: Coroutine[Any, Any, T], name: str | None = None) -> asyncio.Task[T]:
        """Run ``coro`` as a task the instance tracks (and cancels at close)."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s: background task failed", self.settings.name, exc_info=task.exception())

    # -- the model thread ------------------------------------------------------------------------

    async def compute(self, fn: Callable[[*Ts], T], *args: *Ts) -> T:
        """Run ``fn`` on the model thread.

        If the caller is cancelled, this still waits for ``fn`` to return before
        the cancellation goes on: ``fn`` writes into the request's KV blocks, and
        the caller's cleanup frees them.
        """
        fut = asyncio.get_running_loop().run_in_executor(self._model_thread, fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            await asyncio.wait([fut])
            raise

    # -- peers -------------------------------------------------------------------------------------

    async def connect_peer(self, ref: EngineRef, cause: str) -> PeerInfo:
        """The peer's exported memory, connecting when it is new or has a new incarnation."""
        async with self._peer_locks.setdefault(ref.key, asyncio.Lock()):
            known = self._peers.get(ref.key)
            if known is not None and known.engine.incarnation == ref.incarnation:
                return known
            try:
                info = await self.engine.connect(ref.address, timeout=self.settings.control_timeout)
            except (MoriioError, OSError, TimeoutError) as exc:
                raise PeerUnavailable(f"cannot reach {ref.key} at {ref.address}: {exc}", cause) from exc
            if info.engine.key != ref.key or info.engine.incarnation != ref.incarnation:
                raise PeerUnavailable(
                    f"{ref.address} is {info.engine.key} incarnation {info.engine.incarnation:#x}, "
                    f"not {ref.key} incarnation {ref.incarnation:#x}: it restarted",
                    cause,
                )
            if known is not None:
                log.info("%s: %s restarted (new incarnation %#x)", self.settings.name, ref.key, ref.incarnation)
            self._peers[ref.key] = info
            return info

    async def session_to(self, ref: EngineRef, cause: str) -> Session:
        """A session from this pool to the peer's pool; a new one when the peer restarted."""
        info = await self.connect_peer(ref, cause)
        async with self._peer_locks[ref.key]:
            session = self._sessions.get(ref.key)
            if (
                session is not None
                and not session.closed
                and not session.stale
                and session.remote.incarnation == ref.incarnation
            ):
                return session
            if "kv" not in info.memory:
                raise PeerUnavailable(f"{ref.key} exports no 'kv' region", cause)
            try:
                fresh = await self.engine.create_session(self.kv, info.memory["kv"])
            except (MoriioError, OSError, TimeoutError) as exc:
                raise PeerUnavailable(f"cannot open a session to {ref.key}: {exc}", cause) from exc
            self._sessions[ref.key] = fresh
            if session is not None:
                self.spawn(session.close())  # its peer is gone or distrusted: abort what is left on it
            return fresh

    async def close_session(self, ref: EngineRef, session: Session) -> None:
        """Close ``session`` (the next ``session_to`` opens a fresh one): what is in flight on it ends, and the
        peer is told to close its answering half before any control message this instance sends it later.

        An abort alone ends this side's transfers, but the peer's half of the pair may still hold a request
        it has not executed (its NIC stalled): it could land after the peer heard that it would not.
        ``close_qp`` travels over the peer's control link ahead of any later message, and a closed answering
        pair executes nothing more.
        """
        if self._sessions.get(ref.key) is session:
            del self._sessions[ref.key]
        await session.close()

    async def peer_gone(self, ref: EngineRef) -> bool:
        """True when ``ref``'s process no longer runs: unreachable, or another incarnation answers.

        Decide this before reusing blocks a peer may still write into: a dead
        process cannot write (its connections and queue pairs died with it).
        """
        try:
            info = await self.engine.connect(ref.address, timeout=min(1.0, self.settings.control_timeout))
        except (MoriioError, OSError, TimeoutError):
            return True
        return info.engine.key != ref.key or info.engine.incarnation != ref.incarnation

    async def notify(self, ref: EngineRef, msg: ControlMessage) -> None:
        """Send a control message to a peer we connected to (or that connected to us)."""
        async with asyncio.timeout(self.settings.control_timeout):
            await self.engine.notify(ref.key, encode_control(msg))

    def notify_soon(self, ref: EngineRef, msg: ControlMessage) -> None:
        """``notify`` in the background: a failure is logged, never raised (the peer may be gone)."""

        async def send() -> None:
            try:
                await self.notify(ref, msg)
            except (MoriioError, OSError, TimeoutError) as exc:
                log.info("%s: %s to %s not delivered: %s", self.settings.name, type(msg).__name__, ref.key, exc)

        self.spawn(send())

    async def _route_notifications(self) -> None:
        decoder = control_decoder()
        while True:
            note = await self.engine.recv_notification()
            try:
                msg = decoder.decode(note.data)
            except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
                log.warning("%s: malformed control message from %s dropped: %s", self.settings.name, note.peer, exc)
                continue
            handler = self.handlers.get(type(msg))
            if handler is None:
                log.warning("%s: unexpected %s from %s dropped", self.settings.name, type(msg).__name__, note.peer)
                continue
            self.spawn(handler(msg, note.peer))

    # -- request accounting ------------------------------------------------------------------------

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        """Count a request in flight for the body; record its outcome."""
        self.requests_in_flight += 1
        self.metrics.requests_in_flight.inc()
        outcome = "error"
        try:
            yield
            outcome = "ok"
        except ServingError as exc:
            outcome = exc.cause or "error"
            raise
        finally:
            self.requests_in_flight -= 1
            self.metrics.requests_in_flight.dec()
            self.metrics.requests.labels(outcome).inc()
            if outcome == "ok":
                self.requests_served += 1


def check_prompt(model: Model, tokens: list[int]) -> None:
    """``ServingError(400)`` unless ``tokens`` is a prompt this model takes."""
    c = model.config
    if not tokens or len(tokens) > c.max_model_len or any(not 0 <= t < c.vocab for t in tokens):
        raise ServingError(400, f"prompt_token_ids must be 1..{c.max_model_len} ids in 0..{c.vocab - 1}")
