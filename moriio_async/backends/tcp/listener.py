"""The rendezvous: the data port, the tokens passive pairs wait on, and both halves of the hello.

A passive pair registers its token (``expect``); the active pair dials the
data port and presents it (``dial``). Every accepted connection is served by
one reactor thread per backend (``reactor.py``): its hello (``hello.py``),
then its chunks (``responder.py``), readiness-driven on a non-blocking
socket, so the threads do not grow with the peers. The token attaches the
connection to the pair it names (each token is good for one dial: it is
forgotten at the first hello that presents it, so a replay finds nothing).
None of this touches asyncio.

What a token is (``qp.py``): with a shared secret, an HMAC under the control
link's session key over both pairs' numbers and the passive pair's nonce, so
only the engine that proved the secret on that link can compute it, and it
never crosses the control link; without one, 16 random bytes sent over the
(unauthenticated) control link, as before.

The hello must arrive whole within ``hello_timeout`` (at most
``connect_timeout``) of the accept, however its bytes are spaced. At most
``TcpOptions.max_data_hellos`` connections may be in their hello at once:
one more closes the oldest one in its hello (a silent one first: nothing had
come by its accept, while an honest dialer sends its hello at once). Over
``max_data_hellos_per_address`` the oldest from that address that had half
its deadline goes. The reactor accepts at most ``_ACCEPTS`` connections per
turn and reads the hellos that came meanwhile before the next ones, and the
kernel's backlog is deep (``_BACKLOG``), so under a crowd of silent or
trickling connections from any number of addresses a real dial waits its
turn and gets in. A connection leaves the set as soon as its hello bytes are
all in, before its token is looked up: one that got that far is never closed
to make room. A hello with an unknown or used token, a bad magic or version,
or too slow, is refused, counted and logged at a rate-limited WARNING
(``DataGuard``); unknown tokens are failed guesses charged to their source,
and a connection from a source over its budget waits a quarter of the hello
deadline (a timer) before its hello is read, until the lockout ends.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
import time

from ...errors import BackendUnavailable, ControlPlaneError, PeerError
from ..base import BackendOptions, specific_options
from ..options import TcpOptions
from ..soft.dial import Expected, closed_on_failure
from .guard import DataGuard
from .hello import Greeting
from .pairstate import PairState
from .reactor import IN, Reactor
from .wire import HELLO, HELLO_ACK, MAGIC, VERSION, HelloStatus, configure_data_socket

__all__ = ["Listener", "dial"]

log = logging.getLogger("moriio_async.tcp")

_WILDCARDS = ("", "0.0.0.0", "::")
_BACKLOG = 4096
"""The kernel's queue of connections not yet accepted: deep, so that under a crowd of connections a real dial
waits its turn in that queue (first come, first accepted) instead of having its SYN dropped and retried
seconds later, a lottery against the crowd's own retries (Linux clips it to ``net.core.somaxconn``)."""
_ACCEPTS = 16
"""Connections accepted per turn of the reactor: then the hellos that came meanwhile are read, so a flood
of newcomers cannot push the connections just accepted out before they were heard."""
_ACCEPT_RETRY = 0.05
"""Seconds the listening socket is not watched after an accept failed for want of fds (EMFILE): no spin."""
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class Listener:
    """The backend's data port and the reactor thread that serves every connection it accepts."""

    def __init__(self, options: BackendOptions, guard: DataGuard) -> None:
        self.options = options
        self.own = specific_options(options, TcpOptions)
        self.guard = guard
        self._lock = threading.Lock()
        self._closed = False
        self._hellos: dict[Greeting, tuple[str, float, bool]] = {}
        """Connections in their hello, oldest first: remote address, accept time, and whether it had sent
        something at accept (the reactor's thread only)."""
        self.expected: Expected[PairState] = Expected()
        """Passive pairs expecting a dial, by token (each goes at its dial, or when its pair closes)."""
        family = socket.AF_INET6 if ":" in options.host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((options.host, 0))
            self._sock.listen(_BACKLOG)
            self._sock.setblocking(False)
            self.port: int = self._sock.getsockname()[1]
            # Peers dial what endpoint() says: a wildcard bind advertises this host's address.
            wildcard = options.host in _WILDCARDS
            self.host = socket.gethostbyname(socket.gethostname()) if wildcard else options.host
        except OSError as exc:
            self._sock.close()
            raise BackendUnavailable(
                f"tcp backend: cannot listen on {options.host!r}: {exc}",
                hint="set BackendOptions.host (IOEngineConfig.host) to an address of this machine",
            ) from exc
        count = self.own.reactor_threads or min(4, os.cpu_count() or 1)
        self.reactors = [Reactor(f"moriio-tcp-nic-{self.port}-{i}") for i in range(count)]
        """Each serves a share of the accepted connections; the first also accepts and hears the hellos."""
        self.reactor = self.reactors[0]
        self.reactor.call_soon(self._watch_port)

    @property
    def waiting(self) -> int:
        """Tokens of passive pairs not dialed yet (each goes at its dial, or when its pair closes)."""
        return len(self.expected)

    def close(self) -> None:
        """Stop accepting, end every connection and join the reactor's thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.reactor.stop(self._closing)  # first: no connection is handed to another reactor after it
        for reactor in self.reactors[1:]:
            reactor.stop(_nothing)
        self._sock.close()

    def _closing(self) -> None:
        """On the reactor, as it stops: connections still in their hello are closed (the reactor ends
        every other watched one next)."""
        self.reactor.unwatch(self._sock.fileno())
        for greeting in list(self._hellos):
            greeting.shutdown()

    # -- on the reactor's thread ----------------------------------------------------------------------

    def _watch_port(self) -> None:
        self.reactor.watch(self._sock.fileno(), self, IN)

    def shutdown(self) -> None:
        """The listening socket as a watched handler: the listener closes it itself."""

    def ready(self, events: int) -> None:
        """The listening socket is readable: accept up to ``_ACCEPTS`` connections."""
        for _ in range(_ACCEPTS):
            try:
                conn, addr = self._sock.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_FDS:  # do not spin: look again a little later
                    self.reactor.unwatch(self._sock.fileno())
                    self.reactor.call_at(time.monotonic() + _ACCEPT_RETRY, self._watch_port)
                log.warning("tcp backend port %d: accept failed: %s", self.port, exc)
                return
            self._admit(conn, str(addr[0]))

    def _admit(self, conn: socket.socket, host: str) -> None:
        conn.setblocking(False)
        talking = _talking(conn)
        for victim, victim_host in self._make_room(host):
            victim.shutdown()
            self.guard.evicted_hello(victim_host)
        greeting = Greeting(conn, host, self, self.reactor, self.guard, self._hello_deadline,
                            self.options.retry_timeout)  # fmt: skip
        self._hellos[greeting] = (host, time.monotonic(), talking)
        greeting.start(self.guard.delayed(host))

    def hello_in(self, greeting: Greeting) -> None:
        self._hellos.pop(greeting, None)

    def claim(self, token: bytes) -> PairState | None:
        return self.expected.claim(token)

    def shard(self) -> Reactor:
        return min(self.reactors, key=lambda r: r.watched)

    @property
    def _hello_deadline(self) -> float:
        return min(self.options.hello_timeout, self.options.connect_timeout)

    def _make_room(self, host: str) -> list[tuple[Greeting, str]]:
        """Take out of their hello the connections that must go for one from ``host`` (the caller closes
        them). Over ``max_data_hellos_per_address``: the oldest from ``host`` that had half its deadline.
        At ``max_data_hellos``: the oldest silent one (nothing had come by its accept; an honest dialer
        sends its hello at once), else the oldest."""
        ripe_since = time.monotonic() - self._hello_deadline / 2
        evicted: list[tuple[Greeting, str]] = []

        def take(pick: list[Greeting]) -> bool:
            if pick:
                evicted.append((pick[0], self._hellos.pop(pick[0])[0]))
            return bool(pick)

        if sum(h == host for h, _, _ in self._hellos.values()) >= self.own.max_data_hellos_per_address:
            take([g for g, (h, since, _) in self._hellos.items() if h == host and since <= ripe_since])
        if len(self._hellos) >= self.own.max_data_hellos:
            # Every one here has not got its whole hello in yet (it leaves the set as it does): the oldest
            # silent one goes (nothing at accept), else the oldest.
            silent = [g for g, (_, _, said) in self._hellos.items() if not said]
            take(silent or list(self._hellos))
        return evicted


def _nothing() -> None:
    pass


def _talking(sock: socket.socket) -> bool:
    """The client had sent something by its accept (peeked, not read; never waits)."""
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except OSError:  # BlockingIOError: nothing yet
        return False


def _host(sock: socket.socket) -> str:
    try:
        return str(sock.getpeername()[0])
    except OSError:
        return "?"


def dial(host: str, port: int, token: bytes, qp_num: int, options: BackendOptions) -> socket.socket:
    """The active half: open the data connection to the passive pair and present its token."""
    deadline = time.monotonic() + options.connect_timeout
    where = f"{host}:{port}"
    try:
        sock = socket.create_connection((host, port), timeout=options.connect_timeout)
    except OSError as exc:
        raise ControlPlaneError(
            f"qp {qp_num}: cannot open the data connection to {where}: {exc}",
            hint="check that the peer's backend is up and its data port is reachable",
        ) from exc
    with closed_on_failure(sock, f"qp {qp_num}: handshake with {where} failed"):
        sock.sendall(HELLO.pack(MAGIC, VERSION, 0, token, qp_num))
        ack = bytearray(HELLO_ACK.size)
        view = memoryview(ack)
        while view:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            n = sock.recv_into(view)
            if not n:
                raise ConnectionResetError("connection closed during the handshake")
            view = view[n:]
        magic, version, status, _peer_qp = HELLO_ACK.unpack(ack)
        if magic != MAGIC:
            raise ControlPlaneError(f"qp {qp_num}: {where} is not a moriio tcp data port")
        if version != VERSION or status == HelloStatus.BAD_VERSION:
            raise ControlPlaneError(
                f"qp {qp_num}: {where} speaks tcp wire version {version}, this side {VERSION}",
                hint="run the same moriio_async version on both sides",
            )
        if status != HelloStatus.OK:
            raise PeerError(
                f"qp {qp_num}: {where} refused the queue-pair token ({HelloStatus(status).name})",
                hint="the passive pair was closed or its engine restarted; exchange endpoints again",
            )
        configure_data_socket(sock, options.retry_timeout)
    return sock
