"""``IOEngine``: the facade of one process's transfer engine (lifecycle, registered memory, config).

Used as ``async with IOEngine("prefill-0", IOEngineConfig(...)) as engine``.
It opens the backend and composes three collaborators, handing each down what
it needs: a ``CompletionRouter`` (the completion path and transfer books), a
``PeerTable`` (peers, links and the control plane) and a ``MemoryRegistry``;
sessions get the router and the peer table, never the engine. Every engine
draws a fresh incarnation id, ordered by start time; descriptors carry it, so
a peer that restarted under the same key is never written through stale
handles. With a shared secret (``IOEngineConfig.secret`` or
``$MORIIO_ASYNC_SECRET``) every peer proves it in the hello; without one the
engine says at start that it accepts anyone who can reach it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import threading
from collections.abc import AsyncIterator, Iterable
from typing import final

from ..aio.transfer import Transfer
from ..aio.wait import waiting_for_transfer_complete
from ..backends.base import Backend
from ..backends.described import BackendFacts
from ..control.book import PeerInfo
from ..control.guard import Guard
from ..control.handshake import Handshake
from ..control.inbound import InboundStatuses
from ..control.inbox import Inbox, Notification
from ..core.protocol import MAX_KEY
from ..descriptors import EngineDesc, MemoryDesc, new_incarnation
from ..errors import EngineClosed, InvalidArgument
from ..status import Access, StatusCode
from .config import IOEngineConfig
from .memory import LocalRegion, MemoryRegistry
from .running import Running, log_trust
from .session import Session
from .statistics import IDLE_ROUTER, NO_PEERS, EngineStatistics, InboundStatistics
from .transports import open_backends
from .uids import TransferUids, check_uid

__all__ = ["IOEngine"]

log = logging.getLogger("moriio_async")


@final
class IOEngine:
    """The transfer engine of one process (or one GPU rank)."""

    def __init__(self, key: str, config: IOEngineConfig | None = None) -> None:
        if not key or not isinstance(key, str):
            raise InvalidArgument("engine key must be a non-empty string")
        if len(key) > MAX_KEY:
            raise InvalidArgument(f"engine key is {len(key)} characters; the control plane carries at most {MAX_KEY}")
        self.key = key
        self.config = config or IOEngineConfig()
        if len(key) > self.config.max_key:
            raise InvalidArgument(
                f"engine key is {len(key)} characters; IOEngineConfig.max_key is {self.config.max_key}"
            )
        self._secret = self.config.resolved_secret()
        self.incarnation = new_incarnation()
        self.closed = True
        self._started = False
        self._backends: list[Backend] = []
        """Every open backend, best first."""
        self._running: Running | None = None
        """The collaborators of the current (or last) run; kept after close for ``statistics``."""
        self._memory = MemoryRegistry(key, self.incarnation)
        self._sessions: set[Session] = set()
        self._inbox = self._new_inbox()
        self._inbound = InboundStatuses(self.config.max_inbound_statuses, self.config.max_inbound_status_bytes)
        self._uids = TransferUids()
        self._guard = Guard(max_failures=self.config.max_failures_per_source, lockout=self.config.failure_lockout)
        self._port = 0
        self._thread = 0
        """The thread running the engine's loop, once started: the sync calls that change state run only there."""
        self.loop: asyncio.AbstractEventLoop

    # -- life cycle ------------------------------------------------------------------------------

    async def start(self) -> IOEngine:
        """Open the backend, start the completion reader and the control-plane listener."""
        if self._started:
            raise InvalidArgument("engine already started")
        self._started = True
        self.loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        if self._inbox.closed:
            self._inbox = self._new_inbox()
        cfg = self.config
        # Opening a device can take a while (verbs); keep the loop free meanwhile.
        backends = self._backends = await self.loop.run_in_executor(None, open_backends, cfg)
        self._running = None
        try:
            self._running = Running.open(
                self.loop,
                backends,
                key=self.key,
                incarnation=self.incarnation,
                config=cfg,
                memory=self._memory,
                inbox=self._inbox,
                inbound=self._inbound,
                handshake=Handshake(self._secret, max_key=cfg.max_key),
                guard=self._guard,
            )
            router, peers = self._running.router, self._running.peers
            router.start()
            self._port = (await peers.listen(cfg.host, cfg.port)).port
        except BaseException:
            await self._teardown()
            self._started = False
            raise
        self.closed = False
        log.info(
            "engine %s listening on %s (%s %s)", self.key, self.address,
            "transports" if len(backends) > 1 else "backend", ", ".join(b.name for b in backends),
        )  # fmt: skip
        log_trust(self.key, self.address, authenticated=self._secret is not None, loopback_only=peers.loopback_only)
        return self

    def _new_inbox(self) -> Inbox:
        return Inbox(self.config.max_notifications, self.config.max_notification_bytes)

    async def __aenter__(self) -> IOEngine:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Abort every session, close links and the listener, release the backend. Idempotent."""
        if self.closed and not self._started:
            return
        self.closed = True
        self._started = False
        running = self._running
        if running is not None:
            running.router.begin_close()
            running.peers.begin_close()
        for session in list(self._sessions):
            with contextlib.suppress(Exception):
                await session.close()
        await self._teardown()

    async def _teardown(self) -> None:
        running, backends = self._running, self._backends
        self._backends = []
        if running is not None:
            await running.stop()
        self._inbox.close()
        self._inbound.fail_waiters(EngineClosed(f"engine {self.key!r} closed: no more inbound statuses"))
        loop = asyncio.get_running_loop()
        for backend in backends:
            try:
                closing = loop.run_in_executor(None, backend.close)
            except RuntimeError:
                # The interpreter is exiting: concurrent.futures' exit hook (run before ``atexit``'s, by
                # threading's shutdown) makes every executor refuse work. Close here, blocking the loop:
                # nothing else runs on it any more, and a backend left open keeps its threads and memfds.
                backend.close()
                continue
            # Off the loop, and bounded: a backend whose close is stuck (a NIC thread that never
            # returns) must not keep the engine's close from returning. It goes on in its thread.
            closing.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved, if late
            try:
                await asyncio.wait_for(asyncio.shield(closing), self.config.abort_timeout)
            except TimeoutError:
                log.warning("engine %r: the %s backend's close still runs after %gs; left to finish in its thread",
                            self.key, backend.name, self.config.abort_timeout)  # fmt: skip

    def _require_open(self) -> Running:
        if self.closed or self._running is None:
            raise EngineClosed(f"engine {self.key!r} is not running", hint="use `async with IOEngine(...)`")
        return self._running

    def _on_loop(self, call: str) -> None:
        """Refuse a call made off the engine's loop thread: the tables it changes belong to the loop."""
        if self._thread and threading.get_ident() != self._thread:
            raise InvalidArgument(
                f"IOEngine.{call} was called off the thread running engine {self.key!r}'s event loop",
                hint="call it on the loop (loop.call_soon_threadsafe); from threads, use moriio_async.compat.mori",
            )

    # -- identity --------------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """``host:port`` of the control-plane listener (the port is known once started)."""
        return f"{self.config.host}:{self._port}"

    @property
    def backend_name(self) -> str:
        """The first (preferred) backend's name."""
        return self._require_open().backend.name

    @property
    def transports(self) -> tuple[str, ...]:
        """Every open backend, best first: a session uses the first its peer shares (see ``Session.transport``)."""
        return self._require_open().transports.names

    def get_engine_desc(self) -> EngineDesc:
        """This engine as peers see it (``pack()`` it for MoRI-IO's explicit style)."""
        return self._require_open().peers.local

    def describe_backend(self) -> BackendFacts:
        """The preferred backend's facts (``TcpFacts``, ``CmaFacts``, ... from ``moriio_async.backends.described``)."""
        return self._require_open().backend.describe()

    # -- memory ----------------------------------------------------------------------------------

    def register_memory(
        self, buffer: object, name: str = "", access: Access | None = None, *, export: bool | None = None
    ) -> MemoryDesc:
        """Register a writable, contiguous buffer; a ``name`` lists it to peers at ``connect``.

        Peers reach a region only if it is exported: by default when it has a ``name``; ``export=True``
        exports an unnamed one (whose descriptor you hand to peers yourself), ``export=False`` keeps a
        named one local. See ``export_memory`` and docs/security.md.
        """
        self._on_loop("register_memory")
        return self._memory.register(self._require_open().backends, buffer, name, access, export)

    def export_memory(self, desc: MemoryDesc) -> MemoryDesc:
        """Make a registered region reachable by peers (before packing its descriptor for one); ``desc``."""
        self._on_loop("export_memory")
        self._memory.export(self._require_open().backends, desc)
        return desc

    def allocate_memory(
        self, size: int, name: str = "", access: Access | None = None, *, export: bool | None = None
    ) -> tuple[MemoryDesc, mmap.mmap]:
        """A zeroed buffer from the backend, registered as ``register_memory`` would: ``(desc, buffer)``.

        On the cma backend it is a memfd that same-host peers map and copy with memcpy; elsewhere
        an anonymous mapping. ``np.frombuffer(buffer, np.uint8)`` views it as an array.
        """
        self._on_loop("allocate_memory")
        buffer = self._require_open().backend.allocate_buffer(size)
        return self.register_memory(buffer, name, access, export=export), buffer

    def deregister_memory(self, desc: MemoryDesc) -> None:
        """Deregister now; ``MemoryInUse`` if transfers on it are in flight (see ``release_memory``)."""
        self._on_loop("deregister_memory")
        self._memory.deregister_unused(desc, self._backends or None)

    async def release_memory(self, desc: MemoryDesc, timeout: float | None = None) -> None:
        """Deregister once no transfer uses the region (``TimeoutError`` leaves it registered)."""
        region = self._memory.lookup(desc)
        async with asyncio.timeout(timeout):
            await region.wait_unpinned()
        self._memory.deregister(region, self._backends or None)

    def pins(self, desc: MemoryDesc) -> int:
        """How many transfers still use a registered region (what ``release_memory`` waits for)."""
        return self._memory.lookup(desc).pins

    # -- peers -----------------------------------------------------------------------------------

    def register_remote_engine(self, desc: EngineDesc) -> None:
        """MoRI-IO's explicit style: learn a peer from its packed descriptor (undoes a deregistration)."""
        self._on_loop("register_remote_engine")
        self._require_open().peers.register(desc)

    def deregister_remote_engine(self, peer: EngineDesc | str) -> None:
        """Forget a peer for new work: ``create_session`` to it (and reconnecting an old session) and
        ``notify`` raise ``InvalidArgument`` until ``connect`` or ``register_remote_engine`` names it again.

        Safe with transfers in flight: open sessions keep their queue pairs and
        their transfers end as they would; the peer's own sessions towards this
        engine are untouched. To stop them, close (abort) those sessions.
        Unknown keys are ignored, as in MoRI-IO.
        """
        self._on_loop("deregister_remote_engine")
        self._require_open().peers.forget(peer if isinstance(peer, str) else peer.key)

    async def connect(self, address: str, timeout: float | None = None) -> PeerInfo:
        """Handshake with the engine at ``host:port``; return it and its exported memory."""
        peers = self._require_open().peers
        async with asyncio.timeout(timeout if timeout is not None else self.config.control_timeout):
            return await peers.connect(address)

    # -- sessions and transfers ------------------------------------------------------------------

    async def create_session(self, local_desc: MemoryDesc, remote_desc: MemoryDesc) -> Session:
        """A session between a local region and a remote one; builds and connects its queue pair."""
        running = self._require_open()
        local: LocalRegion = self._memory.lookup(local_desc)
        qp = await running.peers.open_qp(remote_desc)
        try:
            if self.closed:  # close() ran while the pair connected: it would never be closed
                raise EngineClosed(f"engine {self.key!r} closed while the session was created")
            return Session(
                local,
                remote_desc,
                qp,
                router=running.router,
                peers=running.peers,
                uids=self._uids,
                sessions=self._sessions,
                max_wr_bytes=self.config.max_wr_bytes,
                abort_timeout=self.config.abort_timeout,
            )
        except BaseException:
            running.peers.close_qp(qp)
            raise

    def allocate_transfer_uid(self) -> int:
        """A uid for a transfer call's ``uid=``, unique among this engine's transfers in flight (any thread)."""
        return self._uids.allocate()

    def announce_transfer(self, peer_key: str, uid: int, code: StatusCode = StatusCode.SUCCESS) -> None:
        """Send peer ``peer_key`` the ``done`` notice a transfer with ``uid`` sends when it ends, without
        a transfer: for work the caller split over several transfers, or an empty batch. No wait."""
        self._on_loop("announce_transfer")
        self._require_open().peers.announce(peer_key, check_uid(uid), StatusCode(code))

    def pop_inbound_transfer_status(self, peer_key: str, uid: int) -> StatusCode | None:
        """Target side: the code peer ``peer_key``'s transfer ``uid`` ended with, once it ended at the
        peer, and only once; None before (or if the peer gave the transfer no uid). Safe from any thread."""
        return self._inbound.pop(peer_key, uid)

    async def wait_inbound_transfer_status(self, peer_key: str, uid: int, timeout: float | None = None) -> StatusCode:
        """Like ``pop_inbound_transfer_status``, waiting until the peer's notice arrives (``TimeoutError``)."""
        async with asyncio.timeout(timeout):
            return await self._inbound.wait(peer_key, uid)

    @property
    def outstanding(self) -> int:
        """Transfers started and not yet ended, timed-out ones included."""
        return self._running.router.outstanding if self._running is not None else 0

    async def waiting_for_transfer_complete(
        self,
        transfers: Iterable[Transfer] | Transfer | None = None,
        timeout: float | None = None,
        fail_fast: bool = False,
    ) -> None:
        """Like the module function; no list means every outstanding transfer, no timeout the config's."""
        if transfers is None:
            transfers = self._running.router.outstanding_transfers() if self._running is not None else []
        await waiting_for_transfer_complete(
            transfers, self.config.transfer_timeout if timeout is None else timeout, fail_fast
        )

    def drain_completions(self) -> int:
        """Dispatch every completion already queued, now; how many there were.

        The completion reader does this at every wakeup; call it only where a
        backend raises no wakeup (a held mock NIC in tests).
        """
        self._on_loop("drain_completions")
        return self._running.router.drain() if self._running is not None else 0

    # -- notifications ----------------------------------------------------------------------------

    async def notify(self, peer_key: str, data: bytes) -> None:
        """Send a small message to a connected peer; it arrives after data this engine saw complete."""
        await self._require_open().peers.notify(peer_key, data)

    async def recv_notification(self, timeout: float | None = None) -> Notification:
        """The next notification; ``EngineClosed`` once the engine closed and none is left."""
        async with asyncio.timeout(timeout):
            return await self._inbox.get()

    async def notifications(self) -> AsyncIterator[Notification]:
        """Notifications as they arrive; the iteration ends when the engine closes."""
        async for note in self._inbox:
            yield note

    def statistics(self) -> EngineStatistics:
        """A snapshot: identity, counts of sessions, regions, transfers, links and peers, the reader's figures,
        and what peers did wrong (``guard``: refused links and hellos, bad frames, access errors per peer;
        ``data_plane``: refused tokens and connections, bad and slow messages, aborted requests)."""
        running, inbox, held = self._running, self._inbox, self._inbound
        done_dropped = running.peers.dropped_done if running is not None else 0
        return EngineStatistics(
            key=self.key,
            incarnation=self.incarnation,
            authenticated=self._secret is not None,
            transports=running.transports.names if running is not None else (),
            peer_transports=running.peers.chosen_transports() if running is not None else {},
            answering_transports=running.peers.answering_transports() if running is not None else {},
            sessions=len(self._sessions),
            regions=len(self._memory),
            uids_in_flight=len(self._uids),
            router=running.router.statistics() if running is not None else IDLE_ROUTER,
            peers=running.peers.statistics() if running is not None else NO_PEERS,
            guard=self._guard.snapshot(),
            suppressed_log_lines=self._guard.suppressed,
            inbound=InboundStatistics(
                len(inbox), inbox.bytes, len(held), held.bytes, held.dropped, held.dropped_for_bytes, done_dropped
            ),
            data_plane=running.transports.data_plane() if running is not None else {},
        )
