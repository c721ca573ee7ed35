"""``IOEngine``: one backend, one completion reader, a control-plane listener, sessions.

Used as ``async with IOEngine("prefill-0", IOEngineConfig(...)) as engine``.
Every start draws a fresh incarnation id; descriptors carry it, so a peer
that restarted under the same key is never written through stale handles.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import logging
import secrets
import weakref
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any, final

from ..aio.channel import QpChannel
from ..aio.control import ControlLink
from ..aio.cq_reader import CompletionReader
from ..aio.transfer import Transfer
from ..aio.wait import waiting_for_transfer_complete
from ..backends import open_backend
from ..backends.base import Backend, CompletionQueue, QueuePair
from ..descriptors import EngineDesc, MemoryDesc
from ..errors import (
    ControlPlaneError,
    EngineClosed,
    InvalidArgument,
    MemoryInUse,
    StalePeer,
)
from ..status import Access
from ..work import WorkCompletion
from .config import IOEngineConfig
from .memory import LocalRegion, as_region_view
from .session import Session

__all__ = ["IOEngine", "Notification", "PeerInfo"]

log = logging.getLogger("moriio_async")


@dataclass(frozen=True, slots=True)
class Notification:
    """A small message from a peer engine (write_done, release, ...)."""

    peer: str
    data: bytes


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """What ``connect`` learned: the peer engine and the memory it exports by name."""

    engine: EngineDesc
    memory: dict[str, MemoryDesc]


@dataclass(eq=False)
class _Peer:
    desc: EngineDesc
    link: ControlLink | None = None
    passive_qps: dict[int, QueuePair] = field(default_factory=dict)


@final
class IOEngine:
    """The transfer engine of one process (or one GPU rank)."""

    def __init__(self, key: str, config: IOEngineConfig | None = None) -> None:
        if not key or not isinstance(key, str):
            raise InvalidArgument("engine key must be a non-empty string")
        self.key = key
        self.config = config or IOEngineConfig()
        self.incarnation = secrets.randbits(63)
        self.closed = True
        self._started = False
        self._backend: Backend | None = None
        self._cq: CompletionQueue | None = None
        self._reader: CompletionReader | None = None
        self._server: asyncio.Server | None = None
        self._port = 0
        self._regions: dict[int, LocalRegion] = {}
        """By the backend region's lkey, which is unique per device. Not by rkey: a region without
        remote access has no meaningful rkey (rxe gives every one of them rkey 0)."""
        self._peers: dict[str, _Peer] = {}
        self._links: set[ControlLink] = set()
        self._channels: dict[int, QpChannel] = {}
        self._sessions: set[Session] = set()
        self._in_flight: weakref.WeakSet[Transfer] = weakref.WeakSet()
        self._outstanding: set[Transfer] = set()
        self._transfer_ids = itertools.count(1)
        self._notifications: asyncio.Queue[Notification] = asyncio.Queue()
        self.loop: asyncio.AbstractEventLoop

    # -- life cycle ------------------------------------------------------------------------------

    async def start(self) -> IOEngine:
        if self._started:
            raise InvalidArgument("engine already started")
        self._started = True
        self.loop = asyncio.get_running_loop()
        cfg = self.config
        # Opening a device can take a while (verbs); keep the loop free meanwhile.
        self._backend = await self.loop.run_in_executor(None, open_backend, cfg.backend, cfg.backend_options())
        try:
            self._cq = self._backend.create_cq(self._backend_cq_depth())
            self._reader = CompletionReader(
                self.loop, self._cq, self._dispatch, has_work=lambda: bool(self._outstanding)
            )
            self._reader.start()
            self._server = await asyncio.start_server(self._on_accept, cfg.host, cfg.port)
        except BaseException:
            await self._teardown()
            raise
        self._port = self._server.sockets[0].getsockname()[1]
        self.closed = False
        log.info("engine %s listening on %s (backend %s)", self.key, self.address, self._backend.name)
        return self

    def _backend_cq_depth(self) -> int:
        return max(1024, self.config.sq_depth * 8)

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
        for session in list(self._sessions):
            with contextlib.suppress(Exception):
                await session.close()
        await self._teardown()

    async def _teardown(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self._links):
            link.close()
        for link in list(self._links):
            await link.wait_closed()
        for peer in self._peers.values():
            for qp in peer.passive_qps.values():
                self._close_qp(qp)
            peer.passive_qps.clear()
        if self._reader is not None:
            self._reader.drain()
            self._reader.close()
        backend = self._backend
        if self._cq is not None:
            self._cq.close()
        self._backend = self._cq = self._reader = None
        if backend is not None:
            await asyncio.get_running_loop().run_in_executor(None, backend.close)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            self._server = None

    def _require_open(self) -> Backend:
        if self.closed or self._backend is None:
            raise EngineClosed(f"engine {self.key!r} is not running", hint="use `async with IOEngine(...)`")
        return self._backend

    # -- identity --------------------------------------------------------------------------------

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self._port}"

    @property
    def backend_name(self) -> str:
        return self._require_open().name

    def get_engine_desc(self) -> EngineDesc:
        backend = self._require_open()
        return EngineDesc(self.key, self.config.host, self._port, self.incarnation, backend.name)

    def describe_backend(self) -> dict[str, Any]:
        return self._require_open().describe()

    # -- memory ----------------------------------------------------------------------------------

    def register_memory(self, buffer: object, name: str = "", access: Access | None = None) -> MemoryDesc:
        """Register a writable, contiguous buffer; a ``name`` exports it to peers at ``connect``."""
        backend = self._require_open()
        view = as_region_view(buffer)
        if name and any(r.desc.name == name for r in self._regions.values()):
            raise InvalidArgument(f"a region named {name!r} is already registered")
        access = Access.all() if access is None else Access(access)
        mr = backend.register_memory(view, access)
        desc = MemoryDesc(self.key, self.incarnation, name, mr.addr, mr.length, mr.rkey, access)
        self._regions[mr.lkey] = LocalRegion(desc, mr)
        return desc

    def _region(self, desc: MemoryDesc) -> LocalRegion:
        # A scan, not a lookup by rkey (see _regions); an engine holds a handful of regions.
        region = next((r for r in self._regions.values() if r.desc == desc), None)
        if region is None:
            raise InvalidArgument(f"{desc.name or 'region'} is not a live registration of engine {self.key!r}")
        return region

    def deregister_memory(self, desc: MemoryDesc) -> None:
        """Deregister now; ``MemoryInUse`` if transfers on it are in flight (see ``release_memory``)."""
        region = self._region(desc)
        if region.pins:
            raise MemoryInUse(
                f"{region.pins} transfer(s) still use region {desc.name or hex(desc.addr)}",
                hint="await engine.release_memory(desc) to deregister once they end, or abort their sessions first",
            )
        self._deregister(region)

    async def release_memory(self, desc: MemoryDesc, timeout: float | None = None) -> None:
        """Deregister once no transfer uses the region (``TimeoutError`` leaves it registered)."""
        region = self._region(desc)
        async with asyncio.timeout(timeout):
            await region.wait_unpinned()
        self._deregister(region)

    def _deregister(self, region: LocalRegion) -> None:
        region.live = False
        del self._regions[region.mr.lkey]
        if self._backend is not None:
            self._backend.deregister_memory(region.mr)

    def _exported(self) -> list[dict[str, Any]]:
        return [r.desc.to_dict() for r in self._regions.values() if r.desc.name]

    # -- peers and the control plane ---------------------------------------------------------------

    def register_remote_engine(self, desc: EngineDesc) -> None:
        """MoRI-IO's explicit style: learn a peer from its packed descriptor."""
        self._require_open()
        known = self._peers.get(desc.key)
        if known is None or known.desc.incarnation != desc.incarnation:
            self._peers[desc.key] = _Peer(desc)

    async def connect(self, address: str, timeout: float | None = None) -> PeerInfo:
        """Handshake with the engine at ``host:port``; return it and its exported memory."""
        self._require_open()
        host, sep, port_text = address.rpartition(":")
        if not sep or not port_text.isdigit():
            raise InvalidArgument(f"address {address!r} is not host:port")
        async with asyncio.timeout(timeout if timeout is not None else self.config.control_timeout):
            _, reply = await self._dial(host, int(port_text))
        desc = EngineDesc.from_dict(reply["engine"])
        memory = {m.name: m for m in (MemoryDesc.from_dict(d) for d in reply.get("memory", []))}
        return PeerInfo(desc, memory)

    async def _dial(self, host: str, port: int) -> tuple[ControlLink, dict[str, Any]]:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError as exc:
            raise ControlPlaneError(f"cannot reach engine at {host}:{port}: {exc}") from exc
        link = self._new_link(reader, writer)
        link.start()
        try:
            reply = await link.request({"op": "hello", "engine": self.get_engine_desc().to_dict()})
            desc = EngineDesc.from_dict(reply["engine"])
        except BaseException:
            link.close()
            raise
        self._adopt_link(link, desc)
        return link, reply

    def _new_link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> ControlLink:
        link = ControlLink(
            reader,
            writer,
            self._handle,
            max_frame=self.config.max_frame,
            timeout=self.config.control_timeout,
            on_close=self._on_link_closed,
        )
        self._links.add(link)
        return link

    def _adopt_link(self, link: ControlLink, desc: EngineDesc) -> None:
        link.peer_key = desc.key
        peer = self._peers.get(desc.key)
        if peer is None or peer.desc.incarnation != desc.incarnation:
            if peer is not None:
                self._drop_peer(peer)
            peer = self._peers[desc.key] = _Peer(desc)
        if peer.link is None or peer.link.closed:
            peer.link = link

    def _on_link_closed(self, link: ControlLink) -> None:
        self._links.discard(link)
        peer = self._peers.get(link.peer_key or "")
        if peer is not None and peer.link is link:
            peer.link = None
            # Answering pairs exist for the peer's sessions; without its link, nobody will use them.
            for qp in peer.passive_qps.values():
                self._close_qp(qp)
            peer.passive_qps.clear()

    def _drop_peer(self, peer: _Peer) -> None:
        for qp in peer.passive_qps.values():
            self._close_qp(qp)
        peer.passive_qps.clear()

    async def _on_accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = self._new_link(reader, writer)
        try:
            first = await link.read_frame(idle_ok=False)
            if first is None:
                link.close()
                return
            if first.get("op") != "hello" or not isinstance(first.get("id"), int):
                raise ControlPlaneError("the first control frame must be a hello request")
            engine = first.get("engine")
            if not isinstance(engine, dict):
                raise ControlPlaneError("the hello request carries no engine descriptor object")
            desc = EngineDesc.from_dict(engine)
        except (ControlPlaneError, InvalidArgument, OSError) as exc:
            log.warning("control handshake from %s refused: %s", link.peer_address, exc)
            with contextlib.suppress(Exception):
                await link.send({"op": "error", "reason": "handshake", "message": str(exc)})
            link.close()
            return
        if self.closed:
            link.close()  # close() began while the hello was on its way: no answer, no new peer
            return
        self._adopt_link(link, desc)
        try:
            await link.send(
                {
                    "op": "hello",
                    "re": first["id"],
                    "engine": self.get_engine_desc().to_dict(),
                    "memory": self._exported(),
                }
            )
        except ControlPlaneError:
            return  # the client left before the answer; send() closed the link
        link.start()

    async def _handle(self, link: ControlLink, msg: dict[str, Any]) -> dict[str, Any] | None:
        op = msg.get("op")
        peer = self._peers.get(link.peer_key or "")
        if peer is None:
            raise ControlPlaneError("no hello on this link yet")
        if op == "connect_qp":
            return await self._serve_connect_qp(peer, msg)
        if op == "close_qp":
            qp = peer.passive_qps.pop(int(msg.get("qp", -1)), None)
            if qp is not None:
                self._close_qp(qp)
            return {"op": "ok"}
        if op == "memory":
            return {"op": "memory", "memory": self._exported()}
        if op == "notify":
            data = msg.get("data")
            if not isinstance(data, str):
                raise ControlPlaneError("notify without data")
            try:
                raw = base64.b64decode(data, validate=True)
            except ValueError as exc:
                raise ControlPlaneError(f"notify data is not base64: {exc}") from None
            self._notifications.put_nowait(Notification(peer.desc.key, raw))
            return None
        raise ControlPlaneError(f"unknown control op {op!r}")

    async def _serve_connect_qp(self, peer: _Peer, msg: dict[str, Any]) -> dict[str, Any]:
        backend = self._require_open()
        if msg.get("incarnation") != self.incarnation:
            raise StalePeer(
                f"engine {self.key!r} is incarnation {self.incarnation:#x}, "
                f"not {msg.get('incarnation')!r}: it restarted"
            )
        endpoint = msg.get("endpoint")
        if not isinstance(endpoint, dict):
            raise ControlPlaneError("connect_qp without an endpoint")
        assert self._cq is not None
        qp = backend.create_qp(self._cq)
        try:
            await self.loop.run_in_executor(None, qp.connect, endpoint)
        except Exception as exc:
            qp.close()
            raise ControlPlaneError(f"cannot connect the answering queue pair: {exc}") from exc
        peer.passive_qps[qp.qp_num] = qp
        return {"op": "qp", "qp": qp.qp_num, "endpoint": dict(qp.endpoint())}

    async def _link_for(self, key: str) -> tuple[_Peer, ControlLink]:
        peer = self._peers.get(key)
        if peer is None:
            raise InvalidArgument(
                f"unknown peer engine {key!r}", hint="connect() to it or register_remote_engine() first"
            )
        if peer.link is None or peer.link.closed:
            link, _ = await self._dial(peer.desc.host, peer.desc.port)
            peer = self._peers[key]
            if peer.link is None:
                peer.link = link
        assert peer.link is not None
        return peer, peer.link

    async def _open_qp(self, remote: MemoryDesc) -> QueuePair:
        """A connected queue pair to the engine owning ``remote``; ``StalePeer`` if it restarted."""
        backend = self._require_open()
        peer, link = await self._link_for(remote.engine_key)
        if peer.desc.incarnation != remote.incarnation:
            raise StalePeer(
                f"peer {remote.engine_key!r} is now incarnation {peer.desc.incarnation:#x}; "
                f"the region belongs to {remote.incarnation:#x}"
            )
        assert self._cq is not None
        qp = backend.create_qp(self._cq)
        try:
            reply = await link.request(
                {"op": "connect_qp", "incarnation": remote.incarnation, "endpoint": dict(qp.endpoint())}
            )
            endpoint = reply.get("endpoint")
            if not isinstance(endpoint, dict):
                raise ControlPlaneError("connect_qp reply without an endpoint")
            await self.loop.run_in_executor(None, qp.connect, endpoint)
        except BaseException:
            qp.close()
            raise
        return qp

    def _close_qp(self, qp: QueuePair) -> None:
        self._channels.pop(qp.qp_num, None)
        with contextlib.suppress(Exception):
            qp.close()

    def _swap_qp(self, channel: QpChannel, old: QueuePair, new: QueuePair) -> None:
        self._close_qp(old)
        self._channels[new.qp_num] = channel
        channel.replace_qp(new)

    # -- sessions -------------------------------------------------------------------------------

    async def create_session(self, local_desc: MemoryDesc, remote_desc: MemoryDesc) -> Session:
        """A session between a local region and a remote one; builds and connects its queue pair."""
        self._require_open()
        local = self._region(local_desc)
        qp = await self._open_qp(remote_desc)
        session: Session
        channel = QpChannel(
            qp,
            on_failed_idle=lambda ch: session._on_failed_idle(ch),
            on_post=self._reader.kick if self._reader is not None else lambda: None,
        )
        session = Session(self, local, remote_desc, channel)
        self._channels[qp.qp_num] = channel
        self._sessions.add(session)
        return session

    def _forget_session(self, session: Session) -> None:
        self._sessions.discard(session)
        self._close_qp(session.channel.qp)
        peer = self._peers.get(session.peer)
        if peer is not None and peer.link is not None and not peer.link.closed:
            link = peer.link
            qp_num = session.channel.qp.qp_num

            async def tell() -> None:
                with contextlib.suppress(ControlPlaneError):
                    await link.send({"op": "close_qp", "qp": qp_num})

            self.loop.create_task(tell())

    # -- transfers -------------------------------------------------------------------------------

    def _next_transfer_id(self) -> int:
        return next(self._transfer_ids)

    def _track(self, transfer: Transfer, region: LocalRegion) -> None:
        self._outstanding.add(transfer)

        def ended(t: Transfer) -> None:
            self._outstanding.discard(t)
            region.unpin()

        transfer.add_done_callback(ended)

    def _dispatch(self, wcs: list[WorkCompletion]) -> None:
        channels = self._channels
        for wc in wcs:
            channel = channels.get(wc.qp_num)
            if channel is not None:
                channel.on_completion(wc)

    def _drain(self) -> int:
        return self._reader.drain() if self._reader is not None else 0

    @property
    def outstanding(self) -> int:
        """Transfers started and not yet ended, timed-out ones included."""
        return len(self._outstanding)

    async def waiting_for_transfer_complete(
        self,
        transfers: Iterable[Transfer] | Transfer | None = None,
        timeout: float | None = None,
        fail_fast: bool = False,
    ) -> None:
        """Like the module function; no list means every outstanding transfer, no timeout the config's."""
        items = list(self._outstanding) if transfers is None else transfers
        await waiting_for_transfer_complete(
            items, self.config.transfer_timeout if timeout is None else timeout, fail_fast
        )

    # -- notifications ----------------------------------------------------------------------------

    async def notify(self, peer_key: str, data: bytes) -> None:
        """Send a small message to a connected peer; it arrives after data this engine saw complete."""
        self._require_open()
        _, link = await self._link_for(peer_key)
        await link.send({"op": "notify", "data": base64.b64encode(bytes(data)).decode()})

    async def recv_notification(self, timeout: float | None = None) -> Notification:
        async with asyncio.timeout(timeout):
            return await self._notifications.get()

    async def notifications(self) -> AsyncIterator[Notification]:
        while not self.closed:
            yield await self._notifications.get()

    def statistics(self) -> dict[str, Any]:
        reader = self._reader.statistics() if self._reader is not None else None
        return {
            "key": self.key,
            "incarnation": self.incarnation,
            "sessions": len(self._sessions),
            "regions": len(self._regions),
            "outstanding": len(self._outstanding),
            "reader": reader,
        }
