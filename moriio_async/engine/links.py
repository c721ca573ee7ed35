"""The engine's open control links, each with who said hello on it and the answering pairs asked for on it.

A link belongs to the engine (key and incarnation) that said hello on it. An
answering queue pair is kept with the link its ``connect_qp`` came over, so
closing that link closes it, whichever of the peer's links it was. This is
the place for per-link limits (links per address, pairs per link, idle time).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from ..aio.control import ControlLink, LinkHandler
from ..backends.base import QueuePair
from ..descriptors import EngineDesc

__all__ = ["LinkRegistry", "close_quietly", "same_engine"]


def same_engine(a: EngineDesc, b: EngineDesc) -> bool:
    """One engine at one incarnation (its advertised address may differ between descriptors)."""
    return a.key == b.key and a.incarnation == b.incarnation


def close_quietly(qp: QueuePair) -> None:
    with contextlib.suppress(Exception):
        qp.close()


@dataclass(eq=False, slots=True)
class _LinkState:
    desc: EngineDesc | None = None
    """Who said hello on the link (None while the handshake runs)."""
    answering: set[int] = field(default_factory=set)
    """The answering pairs (by number) asked for over this link."""


class LinkRegistry:
    """Every open control link of one engine, handshakes in progress included."""

    def __init__(self, *, max_frame: int, timeout: float) -> None:
        self._max_frame = max_frame
        self._timeout = timeout
        self._links: dict[ControlLink, _LinkState] = {}
        self._answering: dict[int, tuple[ControlLink, EngineDesc, QueuePair]] = {}
        """Every answering pair not closed yet: the link it was asked for on, the engine that asked."""

    def __len__(self) -> int:
        return len(self._links)

    @property
    def answering(self) -> int:
        """Answering queue pairs open for peers, over all links."""
        return len(self._answering)

    def open(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handler: LinkHandler) -> ControlLink:
        """A new link over a fresh connection; it stays here until it closes (``handler.on_link_closed``)."""
        link = ControlLink(reader, writer, handler, max_frame=self._max_frame, timeout=self._timeout)
        self._links[link] = _LinkState()
        return link

    def bind(self, link: ControlLink, desc: EngineDesc) -> bool:
        """``desc`` said hello on ``link``; False if the link closed meanwhile."""
        state = self._links.get(link)
        if state is None:
            return False
        state.desc = desc
        return True

    def engine_of(self, link: ControlLink) -> EngineDesc | None:
        """Who said hello on ``link`` (None before the hello, or once it closed)."""
        state = self._links.get(link)
        return state.desc if state is not None else None

    def another(self, desc: EngineDesc) -> ControlLink | None:
        """An open link ``desc``'s engine said hello on, if any."""
        return next((link for link, s in self._links.items() if s.desc and same_engine(s.desc, desc)), None)

    def keep_answering(self, link: ControlLink, qp: QueuePair) -> bool:
        """Keep ``qp`` with ``link``; False (and ``qp`` is the caller's) if the link closed meanwhile."""
        state = self._links.get(link)
        if state is None or state.desc is None or link.closed:
            return False
        state.answering.add(qp.qp_num)
        self._answering[qp.qp_num] = (link, state.desc, qp)
        return True

    def close_answering(self, link: ControlLink, qp_num: int) -> bool:
        """Close the answering pair ``qp_num`` if the engine behind ``link`` asked for it (over any of its links)."""
        desc = self.engine_of(link)
        entry = self._answering.get(qp_num)
        if desc is None or entry is None or not same_engine(entry[1], desc):
            return False
        self._close_answering(qp_num)
        return True

    def close_all_answering(self, desc: EngineDesc) -> None:
        """``desc``'s engine is gone (a newer incarnation said hello): its sessions' pairs go too."""
        for qp_num in [n for n, (_, owner, _) in self._answering.items() if same_engine(owner, desc)]:
            self._close_answering(qp_num)

    def _close_answering(self, qp_num: int) -> None:
        link, _, qp = self._answering.pop(qp_num)
        state = self._links.get(link)
        if state is not None:
            state.answering.discard(qp_num)
        close_quietly(qp)

    def forget(self, link: ControlLink) -> EngineDesc | None:
        """``link`` closed: drop it and close its answering pairs; who had said hello on it."""
        state = self._links.pop(link, None)
        if state is None:
            return None
        for qp_num in state.answering:
            _, _, qp = self._answering.pop(qp_num)
            close_quietly(qp)  # opened for the peer's sessions over this link; nobody asks for them now
        return state.desc

    async def close(self) -> None:
        """Close every link (each closes its answering pairs) and wait for their tasks."""
        links = list(self._links)
        for link in links:
            link.close()
        for link in links:
            await link.wait_closed()
