"""Queue pairs between this engine and its peers: the ones its sessions open, and the ones it answers.

``QueuePair.connect`` may block (the backend contract), so it never runs on
the event loop, and never on the loop's default executor either: a peer that
names an endpoint which hangs must not hold a worker that other setups (the
backend's own open and close, the application's ``run_in_executor``) wait
for. Each direction has a small executor of its own, and an answering connect
holds its link's lock until its thread is done, so one link never occupies
more than one answering worker however many ``connect_qp`` it sends.

Every pair is told, before it connects, the session key of the link it is set
up over and whether it answers (``QueuePair.bind_session``): the answering
side never dials (the backend contract; the TCP backend refuses an endpoint
that asks it to), and TCP derives its data-plane token from that key. The
answering connect does no network I/O on any backend now; the answering
executor stays as a guard for backends to come.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass
from typing import Generic

from ..backends.base import Endpoint, QueuePair
from ..core.protocol import CloseQp, ConnectQp, QpReady
from ..descriptors import EngineDesc, MemoryDesc
from ..errors import BackendUnavailable, ControlPlaneError, EngineClosed, StalePeer
from .choices import PeerChoices
from .link import ControlLink
from .links import LinkRegistry, close_quietly
from .ports import T, TransportSet

__all__ = ["ANSWER_WORKERS", "OPEN_WORKERS", "Opened", "PairBroker"]

OPEN_WORKERS = 4
"""Threads connecting this engine's own session pairs."""
ANSWER_WORKERS = 4
"""Threads connecting answering pairs for peers (at most one per link at a time)."""


@dataclass(frozen=True, slots=True)
class Opened:
    """A pair one of this engine's sessions opened."""

    qp: QueuePair
    key: str
    """The peer's engine key."""
    incarnation: int
    """The peer's incarnation when the pair was opened (a restarted peer has another)."""
    remote_qp: int
    """The peer's answering pair, as ``close_qp`` names it."""
    link: ControlLink
    """The link it was asked for over: the peer closes its answering half when that link closes."""
    transport: str


class PairBroker(Generic[T]):
    """Opens session pairs over a link, answers peers' ``connect_qp``, and keeps the books of both."""

    def __init__(self, key: str, incarnation: int, *, transports: TransportSet[T], links: LinkRegistry, max_peers: int):
        self._key = key
        self._incarnation = incarnation
        self._transports = transports
        self.choices = PeerChoices(key, transports, capacity=max_peers)
        """Which transport each peer's sessions use."""
        self._links = links
        self._opened: dict[int, Opened] = {}
        self._open_pool = concurrent.futures.ThreadPoolExecutor(OPEN_WORKERS, thread_name_prefix="moriio-qp-open")
        self._answer_pool = concurrent.futures.ThreadPoolExecutor(ANSWER_WORKERS, thread_name_prefix="moriio-qp-answer")
        self.closing = False

    @property
    def opened(self) -> int:
        return len(self._opened)

    def peer_keys(self) -> set[str]:
        """Peers this engine's sessions hold pairs to (never pruned from the peer table)."""
        return {o.key for o in self._opened.values()}

    async def open(
        self, link: ControlLink, peer: EngineDesc, remote: MemoryDesc, transport: str | None = None
    ) -> QueuePair:
        """A connected pair to ``peer`` (its region ``remote``), its answering half asked for over ``link``;
        over ``transport``, or the best one both ends share, demoted once if the kernel refuses it."""
        if transport is not None:
            pinned = self._transports.get(transport)
            if pinned is None:
                raise BackendUnavailable(f"engine {self._key!r} has no {transport} backend open")
            return await self._open_on(pinned, link, peer, remote)
        while True:
            chosen = self.choices.choose(peer)
            try:
                return await self._open_on(chosen, link, peer, remote)
            except BackendUnavailable as exc:  # the probe: the kernel refuses cma to this peer
                if not self.choices.refuse(peer, chosen, exc):
                    raise

    async def _open_on(self, transport: T, link: ControlLink, peer: EngineDesc, remote: MemoryDesc) -> QueuePair:
        qp = self._transports.create_qp(transport)
        try:
            qp.bind_session(self._links.session_key_of(link), answering=False)
            ask = ConnectQp(incarnation=remote.incarnation, endpoint=dict(qp.endpoint()), transport=transport.name)
            ready = await link.request(ask, QpReady)
        except BaseException:
            close_quietly(qp)
            raise
        try:
            await _connect_off_loop(qp, ready.endpoint, self._open_pool)
        except BaseException:
            link.post(CloseQp(qp=ready.qp))  # the answering pair waits for a pair that will never come
            raise
        self._opened[qp.qp_num] = Opened(qp, peer.key, peer.incarnation, ready.qp, link, transport.name)
        self._links.note_opened(link, qp.qp_num)
        return qp

    def usable(self, qp: QueuePair) -> bool:
        """``qp`` is open, and so is the link its answering half is kept with (else the peer closed that half)."""
        opened = self._opened.get(qp.qp_num)
        return opened is not None and opened.qp is qp and not opened.link.closed

    def close(self, qp: QueuePair) -> Opened | None:
        """Close a pair ``open`` gave; what it was (to tell the peer), or None if unknown."""
        opened = self._opened.pop(qp.qp_num, None)
        self._links.drop_opened(qp.qp_num)
        close_quietly(qp)
        return opened

    async def answer(self, link: ControlLink, request: ConnectQp) -> QpReady:
        """Open and connect an answering pair for the peer on ``link``, within the per-link limit."""
        if self.closing:
            raise EngineClosed(f"engine {self._key!r} is closing")
        if request.incarnation != self._incarnation:
            raise StalePeer(
                f"engine {self._key!r} is incarnation {self._incarnation:#x}, "
                f"not {request.incarnation:#x}: it restarted"
            )
        transport = self._transports.get(request.transport)
        if transport is None:
            raise ControlPlaneError(f"engine {self._key!r} has no {request.transport} transport (see its hello)")
        lock = self._links.connect_lock(link)
        if lock is None:
            raise ControlPlaneError("the link closed before its answering queue pair was opened")
        if not self._links.reserve_answering(link):
            limit = self._links.limits.max_answering_per_link
            raise ControlPlaneError(f"at most {limit} answering queue pairs per link (max_answering_qps_per_link)")
        try:
            qp = self._transports.create_qp(transport)
            try:
                qp.bind_session(self._links.session_key_of(link), answering=True)
                async with asyncio.timeout(self._links.limits.timeout):
                    await _connect_off_loop(qp, request.endpoint, self._answer_pool, lock)
            except TimeoutError:
                raise ControlPlaneError(
                    f"the answering queue pair did not connect within {self._links.limits.timeout:g}s"
                ) from None
            except EngineClosed:
                raise
            except Exception as exc:
                raise ControlPlaneError(f"cannot connect the answering queue pair: {exc}") from exc
            if self.closing or not self._links.keep_answering(link, qp):
                close_quietly(qp)  # the link closed while the pair connected: nobody will use it
                raise ControlPlaneError("the link closed while the answering queue pair connected")
        finally:
            self._links.unreserve_answering(link)
        peer = self._links.engine_of(link)
        if peer is not None:
            self.choices.answered(peer, transport.name)
        return QpReady(qp=qp.qp_num, endpoint=dict(qp.endpoint()))

    def close_all(self) -> None:
        """Close every opened pair left (by sessions whose close failed) and stop the executors."""
        for opened in self._opened.values():
            close_quietly(opened.qp)
        self._opened.clear()
        # Not waited for: a worker stuck in a connect ends at the backend's connect timeout, off the loop.
        self._open_pool.shutdown(wait=False, cancel_futures=True)
        self._answer_pool.shutdown(wait=False, cancel_futures=True)


async def _connect_off_loop(
    qp: QueuePair, endpoint: Endpoint, pool: concurrent.futures.Executor, lock: asyncio.Lock | None = None
) -> None:
    """Bring ``qp`` to RTS in a worker of ``pool`` (it may block); on failure or cancellation it is closed.

    Cancelling does not stop the thread, so a cancelled connect closes the pair only once the
    thread is done with it: closing a pair under a running connect is not the backend's to survive.
    ``lock``, if given, is held until the thread is done, not just until this waiter gives up.
    """
    if lock is not None:
        try:
            await lock.acquire()
        except BaseException:
            close_quietly(qp)
            raise
    try:
        connecting = asyncio.get_running_loop().run_in_executor(pool, qp.connect, endpoint)
    except RuntimeError as exc:  # the executor was shut down: the engine closes
        if lock is not None:
            lock.release()
        close_quietly(qp)
        raise EngineClosed("the engine closed while a queue pair connected") from exc
    if lock is not None:
        connecting.add_done_callback(lambda _: lock.release())
    try:
        await asyncio.shield(connecting)
    except asyncio.CancelledError:

        def close_after(fut: asyncio.Future[None]) -> None:
            if not fut.cancelled():
                fut.exception()  # retrieved: the connect's own failure does not matter any more
            close_quietly(qp)

        connecting.add_done_callback(close_after)
        raise
    except BaseException:
        close_quietly(qp)
        raise
