"""What peers ask of this engine over its control links, and what their notices tell it.

``Answers`` is the ``LinkHandler`` of every link the peer table opens, dialed
or accepted. A link is answered only once its hello was said (and, with a
secret, proved) for the incarnation the peer book knows; a notice speaks for
its link's key, never a key in its body. Pairs a peer asks for are the
broker's (``pairs``); who is known is the book's (``book``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic

from ..core.framing import FrameError
from ..core.protocol import (
    Done,
    Exports,
    Hello,
    ListMemory,
    Notice,
    Notify,
    Proof,
    Reply,
    Request,
)
from ..descriptors import MemoryDesc
from ..errors import ControlPlaneError
from .book import Peer, PeerBook
from .guard import Guard
from .inbound import InboundStatuses
from .inbox import Inbox, Notification
from .link import ControlLink
from .links import LinkRegistry
from .pairs import PairBroker
from .ports import T

__all__ = ["Answers"]


class Answers(Generic[T]):
    """The ``LinkHandler`` for every link of one engine: requests, notices, bad frames and closes."""

    def __init__(
        self,
        peers: PeerBook,
        links: LinkRegistry,
        pairs: PairBroker[T],
        *,
        exports: Callable[[], list[MemoryDesc]],
        inbox: Inbox,
        inbound: InboundStatuses,
        guard: Guard,
    ) -> None:
        self._peers = peers
        self._links = links
        self._pairs = pairs
        self._exports = exports
        """The regions this engine exports, as a ``list_memory`` reply and the welcome carry them."""
        self._inbox = inbox
        self._inbound = inbound
        self._guard = guard

    async def on_request(self, link: ControlLink, request: Request) -> Reply:
        if isinstance(request, Hello | Proof):
            raise ControlPlaneError("hello was already said on this link")
        self._peer_of(link)
        if isinstance(request, ListMemory):
            return Exports(memory=self._exports())
        return await self._pairs.answer(link, request)

    async def on_notice(self, link: ControlLink, notice: Notice) -> None:
        try:
            peer = self._peer_of(link)
        except ControlPlaneError as exc:
            self._guard.dropped_notice(link.peer_host, link.peer_address, type(notice).__name__, str(exc))
            return
        if isinstance(notice, Notify):
            await self._inbox.put(Notification(peer.desc.key, notice.data))  # waits while the inbox is full
        elif isinstance(notice, Done):
            if not self._inbound.record(peer.desc.key, notice.uid, notice.code):
                self._guard.dropped_notice(link.peer_host, link.peer_address, "Done", f"code {notice.code}")
        elif not self._links.close_answering(link, notice.qp):
            # Only a pair this link's engine asked for (over any of its links) is closed: a number of
            # another engine's pair, or of none, closes nothing.
            why = f"pair {notice.qp:#x} is not one engine {peer.desc.key!r} asked for (or it is closed already)"
            self._guard.dropped_notice(link.peer_host, link.peer_address, "CloseQp", why)

    def on_bad_frame(self, link: ControlLink, error: FrameError) -> None:
        self._guard.bad_frame(link.peer_host, link.peer_address, error)

    def on_link_closed(self, link: ControlLink) -> None:
        desc = self._links.forget(link)
        peer = self._peers.get(desc.key) if desc is not None else None
        if peer is not None and peer.link is link:
            # Another open link of the same peer carries on, if there is one; else the next request dials.
            peer.link = self._links.another(peer.desc)
        self._peers.prune()

    def _peer_of(self, link: ControlLink) -> Peer:
        desc = self._links.engine_of(link)
        if desc is None:
            raise ControlPlaneError("no hello on this link yet")
        peer = self._peers.get(desc.key)
        if peer is None or peer.desc.incarnation != desc.incarnation:
            raise ControlPlaneError(f"engine {desc.key!r} said hello here as an incarnation since replaced")
        return peer
