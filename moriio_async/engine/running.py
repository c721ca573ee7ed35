"""What an engine has between ``start`` and ``close``: its backends and the collaborators built on them.

``Running.open`` builds them in order (completion queues, router, peer table)
and ``Running.stop`` takes them down in the reverse order, once. The engine
facade owns one ``Running`` at a time and hands its parts down to sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import final

from ..aio.router import TAG_SHIFT, CompletionRouter
from ..backends.base import Backend
from ..control.guard import Guard
from ..control.handshake import Handshake
from ..control.inbound import InboundStatuses
from ..control.inbox import Inbox
from ..control.links import LinkLimits
from ..control.peers import PeerTable
from ..core.auth import SECRET_ENV
from .config import IOEngineConfig
from .fdlimit import raise_fd_limit
from .memory import MemoryRegistry
from .transports import Transport, Transports

__all__ = ["Running", "log_trust"]

log = logging.getLogger("moriio_async")


@final
class Running:
    """The backends with their completion queues, the completion router and the peer table of a started engine."""

    __slots__ = ("backend", "backends", "peers", "router", "stopped", "transports")

    def __init__(self, transports: Transports, router: CompletionRouter, peers: PeerTable[Transport]) -> None:
        self.transports = transports
        self.backend = transports.primary.backend
        """The first (preferred) backend: the one for ``allocate_memory`` and ``describe_backend``."""
        self.backends = [t.backend for t in transports]
        self.router = router
        self.peers = peers
        self.stopped = False

    @classmethod
    def open(
        cls,
        loop: asyncio.AbstractEventLoop,
        backends: list[Backend],
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
        """Build the collaborators on open backends (best first); on failure nothing built is left open."""
        raise_fd_limit(config.max_links)  # every link may bring a data connection or two
        transports = Transports(backends, max(1024, config.sq_depth * 8))
        try:
            router = CompletionRouter(loop, transports.primary.cq)
            for t in list(transports)[1:]:
                router.add_queue(t.cq)
            peers = PeerTable(
                key,
                incarnation,
                transports=transports,
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
                    hello_timeout=config.hello_timeout,
                    max_hellos=config.max_hellos,
                    max_hellos_per_address=config.max_hellos_per_address,
                ),
                handshake=handshake,
                guard=guard,
                max_peers=config.max_peers,
            )
        except BaseException:
            transports.close_queues()
            raise
        # Refusals the NIC threads see are counted and logged per peer on the loop.
        for t in transports:
            t.backend.watch_access_errors(_on_loop(loop, peers.access_error, t.tag))
        return cls(transports, router, peers)

    async def stop(self) -> None:
        """Links and listener, then the completion path, then the queue (once)."""
        if self.stopped:
            return
        self.stopped = True
        await self.peers.close()
        self.router.close()
        self.transports.close_queues()


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


def _on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[int, str], None], tag: int) -> Callable[[int, str], None]:
    """``fn`` called on ``loop`` from a NIC thread (dropped once the loop closed), with the pair
    numbered as the engine numbers the ``tag``-th backend's pairs."""

    def call(qp_num: int, detail: str) -> None:
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(fn, tag << TAG_SHIFT | qp_num, detail)

    return call
