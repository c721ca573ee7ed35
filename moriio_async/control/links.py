"""The engine's open control links: who said hello on each, and what each carries; the per-link limits.

A link belongs to the engine (key and incarnation) that said hello on it,
and once that hello was authenticated, to the session key both sides derived
from it. An answering queue pair is kept with the link its ``connect_qp``
came over, so closing that link closes it, whichever of the peer's links it
was. An opened pair (this engine's session towards the peer) is noted on the
link it was asked for over, since the peer closes its answering half when
that link closes.

Limits kept here: accepted links in all and per remote address (``admit``),
answering pairs per link (``reserve_answering``), and the idle time of a
link that carries nothing (``idle``).

Before its hello completes, an accepted link has proved nothing, so it may
not keep out one that can: at most ``max_hellos`` of them at once, below
``max_links``, so the rest is a reserve for links whose hello completed. A
new connection over that cap closes one in its hello (``make_room``): the
oldest that has not sent a whole message, a silent one first (its whole
first frame had not come by its accept: the listener peeks; a trickle of
bytes is silent), else the oldest that had
``hello_grace`` (half its deadline); only when every one is younger and has
sent a whole message is the newcomer refused. The listener takes only a few
connections a wakeup and has a deep backlog, so the hello of an honest
dialer, sent at once, is read before a flood of newcomers could push it
out, and a dialer waits its turn in the kernel's queue instead of losing
its SYN. Over ``max_hellos_per_address``, the oldest of that address's links
in their hello that had ``hello_grace`` goes. At the link caps, any link in
its hello makes room, then (``max_links``) the link idle the longest; only
links carrying something are never closed to make room. A silent or
trickling client thus holds its place for at most ``hello_timeout``, and
only until newer connections need the room: a crowd of them from any number
of addresses delays a legitimate hello, never keeps it out.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from ..backends.base import QueuePair
from ..descriptors import EngineDesc
from .link import ControlLink, LinkHandler

__all__ = ["LinkLimits", "LinkRegistry", "close_quietly", "same_engine"]


def same_engine(a: EngineDesc, b: EngineDesc) -> bool:
    """One engine at one incarnation (its advertised address may differ between descriptors)."""
    return a.key == b.key and a.incarnation == b.incarnation


def close_quietly(qp: QueuePair) -> None:
    with contextlib.suppress(Exception):
        qp.close()


@dataclass(frozen=True, slots=True)
class LinkLimits:
    """What one engine lets its peers hold (``IOEngineConfig`` documents each)."""

    max_frame: int
    timeout: float
    max_links: int
    max_links_per_address: int
    idle_timeout: float
    max_answering_per_link: int
    hello_timeout: float = 5.0
    max_hellos: int = 128
    max_hellos_per_address: int = 32

    @property
    def hello_deadline(self) -> float:
        """Seconds an accepted link has for its whole hello (proof included)."""
        return min(self.hello_timeout, self.timeout)

    @property
    def hello_grace(self) -> float:
        """Seconds a link in its hello is safe from being closed to make room: an honest dialer sends its
        hello at once, so only one that had this long (half its deadline) and still did not finish goes first."""
        return self.hello_deadline / 2


@dataclass(eq=False, slots=True)
class _LinkState:
    accepted: bool
    opened_at: float = 0.0
    """Loop time of the accept (the link's ``last_activity`` moves on once a whole message arrived)."""
    talking: bool = False
    """The client's whole first frame had arrived when it was accepted (an honest dialer sends its hello at once)."""
    desc: EngineDesc | None = None
    """Who said hello on the link (None while the handshake runs)."""
    session_key: bytes | None = None
    """Derived from the authenticated hello (None without a secret)."""
    answering: set[int] = field(default_factory=set)
    """The answering pairs (by number) asked for over this link."""
    connecting: int = 0
    """Answering pairs being connected for this link right now (they count against the limit)."""
    opened: set[int] = field(default_factory=set)
    """This engine's own pairs whose answering half the peer keeps with this link."""
    connect_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """One answering connect at a time per link: a peer cannot hold more than one connect worker per link."""


class LinkRegistry:
    """Every open control link of one engine, handshakes in progress included."""

    def __init__(self, limits: LinkLimits) -> None:
        self.limits = limits
        self._links: dict[ControlLink, _LinkState] = {}
        self._answering: dict[int, tuple[ControlLink, EngineDesc, QueuePair]] = {}
        """Every answering pair not closed yet: the link it was asked for on, the engine that asked."""
        self._accepted: Counter[str] = Counter()
        """Accepted links per remote address."""
        self._hellos: dict[ControlLink, _LinkState] = {}
        """Accepted links whose hello has not completed, oldest first."""
        self._hellos_from: Counter[str] = Counter()
        self.evicted = 0
        """Links in their hello closed to make room for a newer connection."""
        self.evicted_idle = 0
        """Idle links closed at ``max_links`` to make room for a newer connection."""

    def __len__(self) -> int:
        return len(self._links)

    @property
    def answering(self) -> int:
        """Answering queue pairs open for peers, over all links."""
        return len(self._answering)

    # -- admission ---------------------------------------------------------------------------------

    @property
    def in_hello(self) -> int:
        """Accepted links whose hello has not completed."""
        return len(self._hellos)

    def make_room(self, pending: int, talking: bool) -> str | None:
        """Room for one more connection in its hello (``pending``: accepted, not yet open here; ``talking``: its
        whole first frame had arrived at accept)? At the cap one goes (``evict``): the oldest silent one (nothing at
        accept, no whole message since), else the oldest that has not sent a whole message, else the oldest
        that had ``hello_grace``. None if there is room now, else why not: every one in its hello is young
        and has sent a whole message (a crowd that proves nothing never gets there)."""
        limits = self.limits
        while len(self._hellos) + pending >= min(limits.max_hellos, limits.max_links):
            if not self._evict(None, grace=False, unread_only=True) and not self._evict(None, grace=True):
                return f"this engine holds its maximum of {limits.max_hellos} control connections in their hello"
        return None

    def admit(self, host: str, pending_from_host: int, pending: int) -> str | None:
        """Why a new connection from ``host`` is refused (the link caps), or None to accept it.

        Over ``max_hellos_per_address``, the first of that address's links in their hello for
        ``hello_grace`` is closed (a burst of honest dialers from one address is not cut short: the global
        cap, ``make_room``, bounds those). At the link caps, a link in its hello (however young) makes room;
        only when none does is the new connection refused.
        """
        limits = self.limits
        if self._hellos_from[host] + pending_from_host >= limits.max_hellos_per_address:
            self._evict(host, grace=True)
        while self._accepted.total() + pending >= limits.max_links:
            if not self._evict(None, grace=False) and not self._evict_idle():
                return f"this engine holds its maximum of {limits.max_links} accepted control links (max_links)"
        while self._accepted[host] + pending_from_host >= limits.max_links_per_address:
            if not self._evict(host, grace=False):
                return (
                    f"this engine holds its maximum of {limits.max_links_per_address} control links from "
                    f"{host} (max_links_per_address)"
                )
        return None

    def _evict(self, host: str | None, *, grace: bool, unread_only: bool = False) -> bool:
        """Close the link in its hello that goes first (from ``host``, or any; with ``grace``, of those in
        their hello for ``hello_grace`` at least; with ``unread_only``, of those no whole message came on): the
        oldest silent one (nothing at accept, no whole message since), else the oldest unread one, else the
        oldest. False if there is none."""
        candidates = [link for link in self._hellos if host is None or link.peer_host == host]
        if grace:
            ripe = asyncio.get_running_loop().time() - self.limits.hello_grace
            candidates = [link for link in candidates if self._hellos[link].opened_at <= ripe]
        unread = [link for link in candidates if link.last_activity <= self._hellos[link].opened_at]
        if unread_only:
            candidates = unread
        if not candidates:
            return False
        silent = [link for link in unread if not self._hellos[link].talking]
        victim = (silent or unread or candidates)[0]
        self.evicted += 1
        victim.close()  # on_link_closed -> forget: the counts drop now
        if victim in self._hellos:  # a handler that did not forget it: never loop on it
            self._drop_hello(victim)
        return True

    def _evict_idle(self) -> bool:
        """At ``max_links`` with no link in its hello: close the accepted link idle the longest, if it carries
        nothing and has been idle for ``hello_grace`` at least (its peer dials again when it needs it, as
        after ``link_idle_timeout``). Without a secret anyone can say a valid hello: links kept open idle
        must not fill the cap for good. False if there is none."""
        now = asyncio.get_running_loop().time()
        idle = [
            link
            for link, s in self._links.items()
            if s.accepted and s.desc is not None and not (s.answering or s.opened or s.connecting or link.busy)
            and now - link.last_activity >= self.limits.hello_grace
        ]  # fmt: skip
        if not idle:
            return False
        self.evicted_idle += 1
        min(idle, key=lambda link: link.last_activity).close()
        return True

    def _drop_hello(self, link: ControlLink) -> None:
        if self._hellos.pop(link, None) is not None:
            self._hellos_from[link.peer_host] -= 1
            if self._hellos_from[link.peer_host] <= 0:
                del self._hellos_from[link.peer_host]

    def open(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        handler: LinkHandler,
        *,
        accepted: bool,
        talking: bool = False,
    ) -> ControlLink:
        """A new link over a fresh connection; it stays here until it closes (``handler.on_link_closed``).
        ``talking``: an accepted client's whole first frame had arrived by its accept."""
        link = ControlLink(reader, writer, handler, max_frame=self.limits.max_frame, timeout=self.limits.timeout)
        state = self._links[link] = _LinkState(accepted, link.last_activity, talking)
        if accepted:
            self._accepted[link.peer_host] += 1
            self._hellos[link] = state
            self._hellos_from[link.peer_host] += 1
        return link

    def bind(self, link: ControlLink, desc: EngineDesc, session_key: bytes | None) -> bool:
        """``desc`` said hello on ``link`` (and proved it, with a session key); False if the link closed meanwhile."""
        state = self._links.get(link)
        if state is None or link.closed:
            return False
        state.desc = desc
        state.session_key = session_key
        self._drop_hello(link)  # its hello completed: no longer one that may be closed to make room
        return True

    # -- who is on which link ----------------------------------------------------------------------

    def engine_of(self, link: ControlLink) -> EngineDesc | None:
        """Who said hello on ``link`` (None before the hello, or once it closed)."""
        state = self._links.get(link)
        return state.desc if state is not None else None

    def session_key_of(self, link: ControlLink) -> bytes | None:
        """The key of ``link``'s authenticated hello (data-plane tokens derive from it); None without one."""
        state = self._links.get(link)
        return state.session_key if state is not None else None

    def another(self, desc: EngineDesc) -> ControlLink | None:
        """An open link ``desc``'s engine said hello on, if any."""
        return next((link for link, s in self._links.items() if s.desc and same_engine(s.desc, desc)), None)

    def keys_with_links(self) -> set[str]:
        """Engine keys with at least one open link."""
        return {s.desc.key for s in self._links.values() if s.desc is not None}

    def close_superseded(self, desc: EngineDesc) -> None:
        """``desc`` superseded an earlier incarnation of its engine: close that one's links (and so its pairs)."""
        for link, state in list(self._links.items()):
            if state.desc is not None and state.desc.key == desc.key and state.desc.incarnation != desc.incarnation:
                link.close()

    # -- answering and opened pairs ----------------------------------------------------------------

    def connect_lock(self, link: ControlLink) -> asyncio.Lock | None:
        state = self._links.get(link)
        return state.connect_lock if state is not None else None

    def reserve_answering(self, link: ControlLink) -> bool:
        """Count one more answering pair on ``link`` before connecting it; False at the per-link limit."""
        state = self._links.get(link)
        if state is None or len(state.answering) + state.connecting >= self.limits.max_answering_per_link:
            return False
        state.connecting += 1
        return True

    def unreserve_answering(self, link: ControlLink) -> None:
        state = self._links.get(link)
        if state is not None:
            state.connecting -= 1

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

    def owner_of_answering(self, qp_num: int) -> EngineDesc | None:
        """The engine that asked for answering pair ``qp_num`` (None if it is not one)."""
        entry = self._answering.get(qp_num)
        return entry[1] if entry is not None else None

    def note_opened(self, link: ControlLink, qp_num: int) -> None:
        state = self._links.get(link)
        if state is not None:
            state.opened.add(qp_num)

    def drop_opened(self, qp_num: int) -> None:
        for state in self._links.values():
            state.opened.discard(qp_num)

    # -- idle links and closing --------------------------------------------------------------------

    def idle(self, now: float) -> list[ControlLink]:
        """Links past their idle time: hello said, no pair either way, nothing under way.

        A link this engine dialed goes idle at half the timeout, so with equal
        settings the dialer closes first: a listener's idle close then never
        races a message the dialer is sending.
        """
        timeout = self.limits.idle_timeout
        return [
            link
            for link, s in self._links.items()
            if s.desc is not None
            and not (s.answering or s.opened or s.connecting or link.busy)
            and now - link.last_activity >= (timeout if s.accepted else timeout / 2)
        ]

    async def sweep(self, on_idle: Callable[[str, float], None]) -> None:
        """Close idle links for good (a timer, not a task per link); ``on_idle(address, seconds)`` for each."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(self.limits.idle_timeout / 4, 5.0))
            now = loop.time()
            for link in self.idle(now):
                on_idle(link.peer_address, now - link.last_activity)
                link.close()

    def forget(self, link: ControlLink) -> EngineDesc | None:
        """``link`` closed: drop it and close its answering pairs; who had said hello on it."""
        state = self._links.pop(link, None)
        if state is None:
            return None
        self._drop_hello(link)
        if state.accepted:
            self._accepted[link.peer_host] -= 1
            if self._accepted[link.peer_host] <= 0:
                del self._accepted[link.peer_host]
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
