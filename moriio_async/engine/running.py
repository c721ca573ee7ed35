"""What an engine has between ``start`` and ``close``: its backend and the collaborators built on it.

``Running.open`` builds them in order (completion queue, router, peer table)
and ``Running.stop`` takes them down in the reverse order, once. The engine
facade owns one ``Running`` at a time and hands its parts down to sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import final

from ..aio.router import CompletionRouter
from ..backends.base import Backend, CompletionQueue
from ..core.auth import SECRET_ENV
from .config import IOEngineConfig
from .guard import Guard
from .handshake import Handshake
from .inbound import InboundStatuses
from .inbox import Inbox
from .links import LinkLimits
from .memory import MemoryRegistry
from .peers import PeerTable

__all__ = ["Running", "log_trust"]

log = logging.getLogger("moriio_async")


@final
class Running:
    """The backend, its completion queue, the completion router and the peer table of a started engine."""

    __slots__ = ("backend", "cq", "peers", "router", "stopped")

    def __init__(self, backend: Backend, cq: CompletionQueue, router: CompletionRouter, peers: PeerTable) -> None:
        self.backend = backend
        self.cq = cq
        self.router = router
        self.peers = peers
        self.stopped = False

    @classmethod
    def open(
        cls,
        loop: asyncio.AbstractEventLoop,
        backend: Backend,
        *,
        key: str,
        incarnation: int,
        config: IOEngineConfig,
        memory: MemoryRegistry,
        inbox: Inbox,
        inbound: InboundStatuses,
        handshake: Handshake,
        guard: Guard,
    ) -> Running:
        """Build the collaborators on an open backend; on failure nothing built is left open."""
        cq = backend.create_cq(max(1024, config.sq_depth * 8))
        try:
            router = CompletionRouter(loop, cq)
            peers = PeerTable(
                key,
                incarnation,
                backend=backend,
                cq=cq,
                memory=memory,
                inbox=inbox,
                inbound=inbound,
                limits=LinkLimits(
                    max_frame=config.max_frame,
                    timeout=config.control_timeout,
                    max_links=config.max_links,
                    max_links_per_address=config.max_links_per_address,
                    idle_timeout=config.link_idle_timeout,
                    max_answering_per_link=config.max_answering_qps_per_link,
                ),
                handshake=handshake,
                guard=guard,
                max_peers=config.max_peers,
            )
        except BaseException:
            cq.close()
            raise
        # Refusals the NIC threads see are counted and logged per peer on the loop.
        backend.watch_access_errors(_on_loop(loop, peers.access_error))
        return cls(backend, cq, router, peers)

    async def stop(self) -> None:
        """Links and listener, then the completion path, then the queue (once)."""
        if self.stopped:
            return
        self.stopped = True
        await self.peers.close()
        self.router.close()
        self.cq.close()


def log_trust(key: str, address: str, *, authenticated: bool, loopback_only: bool) -> None:
    """Say at start whom the engine accepts: loudly when anyone beyond this host may connect."""
    if authenticated:
        log.info("engine %s: peers must prove the shared secret in the hello", key)
        return
    log.info(
        "engine %s accepts unauthenticated peers: set IOEngineConfig.secret or $%s on every engine to require "
        "a shared secret",
        key,
        SECRET_ENV,
    )
    if not loopback_only:
        log.warning(
            "engine %s listens on %s, reachable beyond this host, WITHOUT a shared secret: any process that can "
            "connect may list, read and write its exported memory; set IOEngineConfig.secret or $%s",
            key,
            address,
            SECRET_ENV,
        )


def _on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[int, str], None]) -> Callable[[int, str], None]:
    """``fn`` called on ``loop`` from a NIC thread (dropped once the loop closed)."""

    def call(qp_num: int, detail: str) -> None:
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(fn, qp_num, detail)

    return call
