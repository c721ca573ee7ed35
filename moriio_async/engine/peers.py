"""Peers and the control plane of one engine: the listener, the handshake and the handlers.

A peer is an engine known by key at one incarnation (from a hello, a
``connect`` or ``register_remote_engine``). A peer may have several links
(both sides dial, or it reconnects; see ``links``); one of them, its current
link, carries this engine's own requests and notices. A newer incarnation of
a peer replaces it and closes the answering pairs of the earlier one.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from ..aio.control import ControlLink
from ..aio.listener import Listener
from ..backends.base import Backend, CompletionQueue, Endpoint, QueuePair
from ..core.protocol import (
    CloseQp,
    ConnectQp,
    EngineRecord,
    Exports,
    Hello,
    ListMemory,
    Notice,
    Notify,
    QpReady,
    RegionRecord,
    Reply,
    Request,
    Welcome,
)
from ..descriptors import EngineDesc, MemoryDesc
from ..errors import ControlPlaneError, EngineClosed, InvalidArgument, StalePeer
from .inbox import Inbox, Notification
from .links import LinkRegistry, close_quietly
from .memory import MemoryRegistry

__all__ = ["PeerInfo", "PeerStatistics", "PeerTable"]

log = logging.getLogger("moriio_async")


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """What ``connect`` learned: the peer engine and the memory it exports by name."""

    engine: EngineDesc
    memory: dict[str, MemoryDesc]


@dataclass(frozen=True, slots=True)
class PeerStatistics:
    peers: int
    """Peer engines known (not pruned yet)."""
    links: int
    """Open control links, handshakes in progress included."""
    answering_qps: int
    """Queue pairs this engine opened for peers' sessions."""
    opened_qps: int
    """Queue pairs this engine's sessions opened towards peers."""


@dataclass(eq=False, slots=True)
class _Peer:
    desc: EngineDesc
    link: ControlLink | None = None
    """The link this engine sends its requests and notices on."""


@dataclass(frozen=True, slots=True)
class _Opened:
    qp: QueuePair
    key: str
    incarnation: int
    remote_qp: int
    """The peer's answering pair, as ``close_qp`` names it."""


class PeerTable:
    """Peers, their links and the control-plane protocol; a ``LinkHandler`` for every link."""

    def __init__(
        self,
        key: str,
        incarnation: int,
        *,
        backend: Backend,
        cq: CompletionQueue,
        memory: MemoryRegistry,
        inbox: Inbox,
        max_frame: int,
        timeout: float,
    ) -> None:
        self.key = key
        self.incarnation = incarnation
        self._backend = backend
        self._cq = cq
        self._memory = memory
        self._inbox = inbox
        self._peers: dict[str, _Peer] = {}
        self._links = LinkRegistry(max_frame=max_frame, timeout=timeout)
        self._opened: dict[int, _Opened] = {}
        self._listener = Listener(self._on_accept)
        self._handshakes: set[asyncio.Task[None]] = set()
        self._local: EngineDesc | None = None
        self._closing = False

    # -- life cycle ------------------------------------------------------------------------------

    async def listen(self, host: str, port: int) -> EngineDesc:
        """Start the control-plane listener; this engine's descriptor, with the port it got."""
        bound = await self._listener.start(host, port)
        self._local = EngineDesc(self.key, host, bound, self.incarnation, self._backend.name)
        return self._local

    @property
    def local(self) -> EngineDesc:
        if self._local is None or self._closing:
            raise EngineClosed(f"engine {self.key!r} is not running", hint="use `async with IOEngine(...)`")
        return self._local

    def begin_close(self) -> None:
        """Answer no hello and grant no queue pair from now on; links stay until ``close``."""
        self._closing = True

    async def close(self) -> None:
        """Stop listening, close every link (and with them the answering pairs) and every pair left open."""
        self._closing = True
        await self._listener.close()
        for task in self._handshakes:
            task.cancel()  # each one's link is in the registry: closing it below closes the connection
        await self._links.close()
        if self._handshakes:
            await asyncio.wait(list(self._handshakes))
        for opened in self._opened.values():
            close_quietly(opened.qp)  # left by a session whose close failed: the backend goes next
        self._opened.clear()

    # -- peers -----------------------------------------------------------------------------------

    def register(self, desc: EngineDesc) -> None:
        """Learn a peer from its descriptor (MoRI-IO's explicit style); a newer incarnation replaces it."""
        self._known(desc)

    async def connect(self, address: str) -> PeerInfo:
        """Handshake with the engine at ``host:port``; it and the memory it exports."""
        host, sep, port_text = address.rpartition(":")
        if not sep or not port_text.isdigit():
            raise InvalidArgument(f"address {address!r} is not host:port")
        _, welcome = await self._dial(host, int(port_text))
        return PeerInfo(welcome.engine.desc(), {m.name: m.desc() for m in welcome.memory})

    async def notify(self, key: str, data: bytes) -> None:
        _, link = await self._link_for(key)
        await link.send(Notify(data=bytes(data)))

    async def open_qp(self, remote: MemoryDesc) -> QueuePair:
        """A connected queue pair to the engine owning ``remote``; ``StalePeer`` if it restarted."""
        peer, link = await self._link_for(remote.engine_key)
        if peer.desc.incarnation != remote.incarnation:
            raise StalePeer(
                f"peer {remote.engine_key!r} is now incarnation {peer.desc.incarnation:#x}; "
                f"the region belongs to {remote.incarnation:#x}"
            )
        qp = self._backend.create_qp(self._cq)
        try:
            ready = await link.request(ConnectQp(incarnation=remote.incarnation, endpoint=dict(qp.endpoint())), QpReady)
        except BaseException:
            close_quietly(qp)
            raise
        try:
            await _connect_off_loop(qp, ready.endpoint)
        except BaseException:
            link.post(CloseQp(qp=ready.qp))  # the answering pair waits for a pair that will never come
            raise
        self._opened[qp.qp_num] = _Opened(qp, peer.desc.key, peer.desc.incarnation, ready.qp)
        return qp

    def close_qp(self, qp: QueuePair) -> None:
        """Close a pair ``open_qp`` gave, and tell the peer to close its answering pair (no wait)."""
        opened = self._opened.pop(qp.qp_num, None)
        close_quietly(qp)
        if opened is None:
            return
        peer = self._peers.get(opened.key)
        # Only the incarnation that answered knows that pair number; a newer one may have reused it.
        if peer is not None and peer.desc.incarnation == opened.incarnation and peer.link is not None:
            peer.link.post(CloseQp(qp=opened.remote_qp))

    def _known(self, desc: EngineDesc) -> _Peer:
        peer = self._peers.get(desc.key)
        if peer is None or peer.desc.incarnation != desc.incarnation:
            if peer is not None:
                self._links.close_all_answering(peer.desc)  # the peer restarted: its earlier sessions are gone
            peer = self._peers[desc.key] = _Peer(desc)
        return peer

    async def _link_for(self, key: str) -> tuple[_Peer, ControlLink]:
        peer = self._peers.get(key)
        if peer is None:
            raise InvalidArgument(
                f"unknown peer engine {key!r}", hint="connect() to it or register_remote_engine() first"
            )
        if peer.link is None or peer.link.closed:
            link, welcome = await self._dial(peer.desc.host, peer.desc.port)
            if welcome.engine.key != key:  # the address now belongs to another engine
                link.close()
                raise ControlPlaneError(f"{peer.desc.address} is engine {welcome.engine.key!r} now, not {key!r}")
            peer = self._peers[key]
            if peer.link is None or peer.link.closed:
                peer.link = link
        assert peer.link is not None
        return peer, peer.link

    # -- links -----------------------------------------------------------------------------------

    def _adopt(self, link: ControlLink, desc: EngineDesc) -> None:
        if not self._links.bind(link, desc):
            return  # closed meanwhile
        peer = self._known(desc)
        if peer.link is None or peer.link.closed:
            peer.link = link

    async def _dial(self, host: str, port: int) -> tuple[ControlLink, Welcome]:
        hello = Hello(engine=EngineRecord.of(self.local))
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError as exc:
            raise ControlPlaneError(f"cannot reach engine at {host}:{port}: {exc}") from exc
        link = self._links.open(reader, writer, self)
        link.start()
        try:
            welcome = await link.request(hello, Welcome)
            if self._closing:
                raise EngineClosed(f"engine {self.key!r} closed during the handshake")
        except BaseException:
            link.close()
            raise
        self._adopt(link, welcome.engine.desc())
        return link, welcome

    def _on_accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._closing:
            writer.close()  # accepted just before close(): no link, no answer
            return
        link = self._links.open(reader, writer, self)
        task = asyncio.get_running_loop().create_task(self._answer_hello(link))
        self._handshakes.add(task)
        task.add_done_callback(self._handshakes.discard)

    async def _answer_hello(self, link: ControlLink) -> None:
        try:
            first = await link.read_message(idle_ok=False)
            if first is None:
                link.close()
                return
            if not isinstance(first, Hello):
                raise ControlPlaneError("the first control frame must be a hello request")
        except (ControlPlaneError, OSError) as exc:
            log.warning("control handshake from %s refused: %s", link.peer_address, exc)
            await link.refuse("handshake", str(exc))
            link.close()
            return
        if self._closing:
            link.close()  # close() began while the hello was on its way: no answer, no new peer
            return
        self._adopt(link, first.engine.desc())
        welcome = Welcome(re=first.id, engine=EngineRecord.of(self.local), memory=self._exports())
        try:
            await link.send(welcome)
        except ControlPlaneError:
            return  # the client left before the answer; send() closed the link
        link.start()

    def _exports(self) -> list[RegionRecord]:
        return [RegionRecord.of(d) for d in self._memory.exported()]

    # -- LinkHandler: what peers ask -------------------------------------------------------------

    async def on_request(self, link: ControlLink, request: Request) -> Reply:
        if isinstance(request, Hello):
            raise ControlPlaneError("hello was already said on this link")
        self._peer_of(link)
        if isinstance(request, ListMemory):
            return Exports(memory=self._exports())
        return await self._serve_connect_qp(link, request)

    async def _serve_connect_qp(self, link: ControlLink, request: ConnectQp) -> QpReady:
        if self._closing:
            raise EngineClosed(f"engine {self.key!r} is closing")
        if request.incarnation != self.incarnation:
            raise StalePeer(
                f"engine {self.key!r} is incarnation {self.incarnation:#x}, not {request.incarnation:#x}: it restarted"
            )
        qp = self._backend.create_qp(self._cq)
        try:
            await _connect_off_loop(qp, request.endpoint)
        except Exception as exc:
            raise ControlPlaneError(f"cannot connect the answering queue pair: {exc}") from exc
        if self._closing or not self._links.keep_answering(link, qp):
            close_quietly(qp)  # the link closed while the pair connected: nobody will use it
            raise ControlPlaneError("the link closed while the answering queue pair connected")
        return QpReady(qp=qp.qp_num, endpoint=dict(qp.endpoint()))

    def on_notice(self, link: ControlLink, notice: Notice) -> None:
        try:
            peer = self._peer_of(link)
        except ControlPlaneError as exc:
            log.info("control link %s: %s dropped: %s", link.peer_address, type(notice).__name__, exc)
            return
        if isinstance(notice, Notify):
            self._inbox.put(Notification(peer.desc.key, notice.data))
        else:
            self._links.close_answering(link, notice.qp)

    def on_link_closed(self, link: ControlLink) -> None:
        desc = self._links.forget(link)
        peer = self._peers.get(desc.key) if desc is not None else None
        if peer is not None and peer.link is link:
            # Another open link of the same peer carries on, if there is one; else the next request dials.
            peer.link = self._links.another(peer.desc)

    def _peer_of(self, link: ControlLink) -> _Peer:
        desc = self._links.engine_of(link)
        if desc is None:
            raise ControlPlaneError("no hello on this link yet")
        peer = self._peers.get(desc.key)
        if peer is None or peer.desc.incarnation != desc.incarnation:
            raise ControlPlaneError(f"engine {desc.key!r} said hello here as an incarnation since replaced")
        return peer

    def statistics(self) -> PeerStatistics:
        return PeerStatistics(len(self._peers), len(self._links), self._links.answering, len(self._opened))


async def _connect_off_loop(qp: QueuePair, endpoint: Endpoint) -> None:
    """Bring ``qp`` to RTS in a worker thread (it may block); on failure or cancellation it is closed.

    Cancelling does not stop the thread, so a cancelled connect closes the pair only once the
    thread is done with it: closing a pair under a running connect is not the backend's to survive.
    """
    connecting = asyncio.get_running_loop().run_in_executor(None, qp.connect, endpoint)
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
