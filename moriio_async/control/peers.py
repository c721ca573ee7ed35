"""Peers and the control plane of one engine: the listener, the hello, what this engine asks its peers.

Who is known, at which incarnation, is the peer book's (``book``). A peer
may have several links (both sides dial, or it reconnects; see ``links``);
one of them, its current link, carries this engine's own requests and
notices. With a shared secret a key is bound only to links that proved it
(``handshake``), so no one without the secret can take a peer's place, its
notifications, its statuses or its pairs; every notice speaks for its link's key, never a body's.

A transfer given a uid announces its end to its target with a ``done``
notice (``post_done``, never waiting: see ``DONE_BACKLOG``); the target files
it (``inbound``). What peers ask is answered by ``answers``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Generic

from ..backends.base import QueuePair
from ..core.framing import FrameError
from ..core.protocol import (
    CloseQp,
    Done,
    Notify,
    Welcome,
)
from ..descriptors import EngineDesc, MemoryDesc
from ..errors import ControlPlaneError, EngineClosed, InvalidArgument, StalePeer
from ..status import StatusCode
from .answers import Answers
from .book import Peer, PeerBook, PeerInfo, PeerStatistics
from .guard import Guard
from .handshake import Handshake, HelloRefused
from .inbound import InboundStatuses
from .inbox import Inbox
from .link import ControlLink
from .links import LinkLimits, LinkRegistry
from .listener import Listener
from .pairs import PairBroker
from .ports import ExportedMemory, T, TransportSet

__all__ = ["DONE_BACKLOG", "PeerTable"]

log = logging.getLogger("moriio_async")

DONE_BACKLOG = 1 << 20
"""Bytes a link may hold unsent before ``done`` notices to its peer are dropped (counted) instead of queued:
a peer that stops reading cannot make this engine buffer them without bound."""


LISTEN_BACKLOG = 2048
"""Connections the kernel queues for the control listener (clipped to ``net.core.somaxconn``)."""


class PeerTable(Generic[T]):
    """Peers, their links and the control-plane protocol: what this engine asks of its peers, the hellos
    it says and answers; what peers ask is ``Answers``'s."""

    def __init__(
        self,
        key: str,
        incarnation: int,
        *,
        transports: TransportSet[T],
        memory: ExportedMemory,
        inbox: Inbox,
        inbound: InboundStatuses,
        limits: LinkLimits,
        handshake: Handshake,
        guard: Guard,
        max_peers: int,
    ) -> None:
        self.key = key
        self.incarnation = incarnation
        self._transports = transports
        self._memory = memory
        self._handshake = handshake
        self._guard = guard
        self._links = LinkRegistry(limits)
        self._pairs = PairBroker(key, incarnation, transports=transports, links=self._links, max_peers=max_peers)
        self._peers = PeerBook(
            self._links, inbound, busy=self._pairs.peer_keys, authenticates=handshake.authenticates,
            max_peers=max_peers,
        )  # fmt: skip
        self._answers = Answers(
            self._peers, self._links, self._pairs, exports=self._exports, inbox=inbox, inbound=inbound, guard=guard
        )
        """What peers ask: the handler of every link this table opens."""
        self.dropped_done = 0
        """``done`` notices not sent: no open link to their peer, or its link held ``DONE_BACKLOG`` unsent."""
        # A deep backlog: under a crowd, a real dialer waits its turn there instead of having its SYN dropped.
        self._listener = Listener(self._on_accept, admit=self._admit, has_room=self._has_room, backlog=LISTEN_BACKLOG)
        self._handshakes: set[asyncio.Task[None]] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._local: EngineDesc | None = None
        self._closing = False

    # -- life cycle ------------------------------------------------------------------------------

    async def listen(self, host: str, port: int) -> EngineDesc:
        """Start the control-plane listener and the idle sweep; this engine's descriptor, with its port."""
        bound = await self._listener.start(host, port)
        t = self._transports
        self._local = EngineDesc(self.key, host, bound, self.incarnation, t.primary.name, t.descs())
        self._sweeper = asyncio.get_running_loop().create_task(self._links.sweep(self._guard.idle))
        return self._local

    @property
    def loopback_only(self) -> bool:
        """The listener accepts connections from this host only."""
        return self._listener.loopback_only

    @property
    def local(self) -> EngineDesc:
        if self._local is None or self._closing:
            raise EngineClosed(f"engine {self.key!r} is not running", hint="use `async with IOEngine(...)`")
        return self._local

    def begin_close(self) -> None:
        """Answer no hello and grant no queue pair from now on; links stay until ``close``."""
        self._closing = True
        self._pairs.closing = True

    async def close(self) -> None:
        """Stop listening, close every link (and with them the answering pairs) and every pair left open."""
        self.begin_close()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        await self._listener.close()
        for task in self._handshakes:
            task.cancel()  # each one's link is in the registry: closing it below closes the connection
        await self._links.close()
        if self._handshakes:
            await asyncio.wait(list(self._handshakes))
        self._pairs.close_all()

    # -- peers -----------------------------------------------------------------------------------

    def register(self, desc: EngineDesc) -> None:
        """Learn a peer from its descriptor (MoRI-IO's explicit style); another incarnation replaces it."""
        self._peers.learn(desc, from_peer=False)

    def forget(self, key: str) -> bool:
        """``deregister_remote_engine``: no new pair to ``key``, no notification (see ``book``);
        False if it is not known."""
        return self._peers.forget(key)

    async def connect(self, address: str) -> PeerInfo:
        """Handshake with the engine at ``host:port``; it and the memory it exports."""
        host, sep, port_text = address.rpartition(":")
        if not sep or not port_text.isdigit():
            raise InvalidArgument(f"address {address!r} is not host:port")
        _, welcome = await self._dial(host, int(port_text))
        self._peers.learn(welcome.engine, from_peer=False)  # connecting to it undoes a deregistration
        return PeerInfo(welcome.engine, {m.name: m for m in welcome.memory})

    async def notify(self, key: str, data: bytes) -> None:
        _, link = await self._link_for(key)
        await link.send(Notify(data=bytes(data)))

    async def open_qp(self, remote: MemoryDesc, transport: str | None = None) -> QueuePair:
        """A connected queue pair to the engine owning ``remote``, over ``transport`` or the best one
        both ends share (``transports``); ``StalePeer`` if it restarted."""
        peer, link = await self._link_for(remote.engine_key)
        if peer.desc.incarnation != remote.incarnation:
            raise StalePeer(
                f"peer {remote.engine_key!r} is now incarnation {peer.desc.incarnation:#x}; "
                f"the region belongs to {remote.incarnation:#x}"
            )
        return await self._pairs.open(link, peer.desc, remote, transport)

    def transport_of(self, qp: QueuePair) -> T:
        """The transport (backend) a pair ``open_qp`` gave runs on."""
        return self._transports.of(qp)

    def chosen_transports(self) -> dict[str, str]:
        """Peer key -> the transport its new sessions use."""
        return self._pairs.choices.chosen()

    def answering_transports(self) -> dict[str, str]:
        """Peer key -> the transport of the pairs it opened to this engine (the target's view)."""
        return self._pairs.choices.answering()

    def close_qp(self, qp: QueuePair) -> None:
        """Close a pair ``open_qp`` gave, and tell the peer to close its answering pair (no wait)."""
        opened = self._pairs.close(qp)
        if opened is None:
            return
        peer = self._peers.get(opened.key)
        # Only the incarnation that answered knows that pair number; a newer one may have reused it.
        if peer is not None and peer.desc.incarnation == opened.incarnation and peer.link is not None:
            peer.link.post(CloseQp(qp=opened.remote_qp))

    def announce(self, key: str, uid: int, code: StatusCode) -> None:
        """``post_done`` to peer ``key`` at its current incarnation, for work that was no single transfer."""
        if code is not StatusCode.SUCCESS and code <= 10:
            raise InvalidArgument(f"{code!r} is not how a transfer ends")
        peer = self._peers.get(key)
        if peer is not None:
            self.post_done(key, peer.desc.incarnation, uid, code)

    def usable(self, qp: QueuePair) -> bool:
        """A pair ``open_qp`` gave is still open at both ends as far as the control plane knows."""
        return self._pairs.usable(qp)

    def post_done(self, key: str, incarnation: int, uid: int, code: StatusCode) -> None:
        """Tell peer ``key`` (still at ``incarnation``) that transfer ``uid`` ended with ``code``; no wait."""
        peer = self._peers.get(key)
        link = peer.link if peer is not None and peer.desc.incarnation == incarnation else None
        if link is None or link.backlog > DONE_BACKLOG or not link.post_soon(Done(uid=uid, code=int(code))):
            self.dropped_done += 1
            log.debug("done notice of transfer uid %d not sent to %s (no open link, or it is backed up)", uid, key)

    def session_key(self, key: str) -> bytes | None:
        """The session key of peer ``key``'s current link (None without a secret or a link).

        Both ends of an authenticated link hold the same key and nobody else
        does: data-plane tokens for that peer derive from it (``core.auth.token_for``).
        """
        peer = self._peers.get(key)
        return self._links.session_key_of(peer.link) if peer is not None and peer.link is not None else None

    def access_error(self, qp_num: int, detail: str) -> None:
        """A remote request on answering pair ``qp_num`` failed the bounds checks: count it against its peer.

        For the data plane (on the loop: a NIC thread calls it with ``call_soon_threadsafe``).
        """
        owner = self._links.owner_of_answering(qp_num)
        self._guard.access_error(owner.key if owner is not None else "?", detail)

    async def _link_for(self, key: str) -> tuple[Peer, ControlLink]:
        peer = self._peers.get(key)
        if peer is None or peer.forgotten:
            what = f"peer engine {key!r} was deregistered" if peer is not None else f"unknown peer engine {key!r}"
            raise InvalidArgument(what, hint="connect() to it or register_remote_engine() first")
        self._peers.touch(key)
        if peer.link is None or peer.link.closed:
            link, welcome = await self._dial(peer.desc.host, peer.desc.port)
            if welcome.engine.key != key:  # the address now belongs to another engine
                link.close()
                raise ControlPlaneError(f"{peer.desc.address} is engine {welcome.engine.key!r} now, not {key!r}")
            peer = self._peers.get(key) or peer
            if peer.link is None or peer.link.closed:
                peer.link = link
        assert peer.link is not None
        return peer, peer.link

    # -- links -----------------------------------------------------------------------------------

    def _adopt(self, link: ControlLink, desc: EngineDesc, session_key: bytes | None) -> bool:
        """Bind ``link`` to the engine that said (and proved) hello on it; False if the link closed meanwhile."""
        peer = self._peers.learn(desc, from_peer=True)
        if not self._links.bind(link, desc, session_key):
            return False
        if peer.link is None or peer.link.closed:
            peer.link = link
        return True

    async def _dial(self, host: str, port: int) -> tuple[ControlLink, Welcome]:
        try:
            async with asyncio.timeout(self._links.limits.timeout):
                reader, writer = await asyncio.open_connection(host, port)
        except (OSError, TimeoutError) as exc:
            raise ControlPlaneError(f"cannot reach engine at {host}:{port}: {exc!r}") from exc
        link = self._links.open(reader, writer, self._answers, accepted=False)
        link.start()
        try:
            welcome, session_key = await self._handshake.dial(link, self.local)
            if self._closing:
                raise EngineClosed(f"engine {self.key!r} closed during the handshake")
            self._adopt(link, welcome.engine, session_key)
        except BaseException:
            link.close()
            raise
        return link, welcome

    def _has_room(self, pending: int, talking: bool) -> str | None:
        evicted = self._links.evicted
        why = self._links.make_room(pending, talking)
        self._guard.evicted(self._links.evicted - evicted)
        if why is not None:
            self._guard.refused_link("*", why)  # keyed on no address: a crowd from many is one line
        return why

    def _admit(self, host: str, pending_from_host: int, pending: int) -> str | None:
        evicted, idle = self._links.evicted, self._links.evicted_idle
        why = self._links.admit(host, pending_from_host, pending)
        self._guard.evicted(self._links.evicted - evicted, idle=self._links.evicted_idle - idle)
        if why is not None:
            self._guard.refused_link(host, why)
        return why

    def _on_accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._closing:
            writer.close()  # accepted just before close(): no link, no answer
            return
        peer = writer.get_extra_info("peername")
        talking = isinstance(peer, tuple) and self._listener.talking(f"{peer[0]}:{peer[1]}")
        link = self._links.open(reader, writer, self._answers, accepted=True, talking=talking)
        task = asyncio.get_running_loop().create_task(self._answer_hello(link))
        self._handshakes.add(task)
        task.add_done_callback(self._handshakes.discard)

    async def _answer_hello(self, link: ControlLink) -> None:
        """The listener's side of the hello, within one deadline; the link changes nothing unless it is welcome."""
        timeout = self._links.limits.hello_deadline  # short: nothing is proved yet (``links``)
        reply_to: int | None = None
        try:
            async with asyncio.timeout(timeout):
                if self._guard.delayed(link.peer_host):  # a guesser's next try costs it this long (a timer)
                    await asyncio.sleep(timeout / 4)
                greeting = await self._handshake.answer(link, self.local)  # EngineClosed once close() began
                if greeting is None or self._closing:
                    link.close()  # the client left, or close() began while the hello was on its way
                    return
                reply_to = greeting.reply_to
                if not self._adopt(link, greeting.desc, greeting.session_key):
                    return
                await link.send(Welcome(re=reply_to, engine=self.local, memory=self._exports()))
        except HelloRefused as exc:
            known = exc.key is not None and exc.key in self._peers
            await self._refuse_hello(
                link, exc.reason, str(exc), exc.re, auth=exc.auth, impersonation=exc.auth and known
            )
            return
        except StalePeer as exc:
            await self._refuse_hello(link, "stale", str(exc), reply_to)
            return
        except FrameError as exc:
            await self._refuse_hello(link, "handshake", str(exc), None)
            return
        except TimeoutError:
            await self._refuse_hello(link, "handshake", f"no complete hello within {timeout:g}s", None)
            return
        except (ControlPlaneError, EngineClosed, OSError):
            link.close()  # the client left before the answer, or the engine began to close
            return
        link.start()

    async def _refuse_hello(
        self,
        link: ControlLink,
        reason: str,
        why: str,
        re: int | None,
        *,
        auth: bool = False,
        impersonation: bool = False,
    ) -> None:
        """Count and log a refused hello, answer it once, and close the link (nothing else was kept)."""
        self._guard.rogue_hello(link.peer_host, link.peer_address, why, auth=auth, impersonation=impersonation)
        try:
            await link.refuse(reason, why, re)
        finally:
            link.close()

    def _exports(self) -> list[MemoryDesc]:
        return list(self._memory.exported())

    def statistics(self) -> PeerStatistics:
        return PeerStatistics(len(self._peers), len(self._links), self._links.answering, self._pairs.opened)
