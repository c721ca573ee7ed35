"""The rendezvous: the data port, the tokens passive pairs wait on, and both halves of the hello.

A passive pair registers its token (``expect``); the active pair dials the
data port and presents it (``dial``); the accept thread hands each connection
a thread of its own that checks the hello (``_answer``), attaches the
connection to the pair the token names (each token is good for one dial: it
is forgotten at the first hello that presents it, so a replay finds nothing)
and then serves it (``Responder.serve``). None of this touches asyncio.

What a token is (``qp.py``): with a shared secret, an HMAC under the control
link's session key over both pairs' numbers and the passive pair's nonce, so
only the engine that proved the secret on that link can compute it, and it
never crosses the control link; without one, 16 random bytes sent over the
(unauthenticated) control link, as before.

The hello must arrive whole within ``hello_timeout`` (at most
``connect_timeout``) of the accept, however its bytes are spaced. At most
``TcpOptions.max_data_hellos`` connections may be in their hello at once:
one more closes the oldest one in its hello (a silent one first: nothing had
come by its accept, while an honest dialer sends its hello at once); its
socket is shut down, which wakes its thread. Over
``max_data_hellos_per_address`` the oldest from that address that had half
its deadline goes. The accept thread pauses a millisecond after each such
close (so the threads just started read their hellos before newcomers could
push them out), and the kernel's backlog is deep (``_BACKLOG``), so under a
crowd of silent or trickling connections from any number of addresses a real
dial waits its turn and gets in. A connection leaves the set as soon as its
hello bytes are all in, before its token is looked up: one that got that far
is never closed to make room. A hello with an unknown or used token, a bad
magic or version, or too slow, is refused, counted and logged at a
rate-limited WARNING (``DataGuard``); unknown tokens are failed guesses
charged to their source, and a connection from a source over its budget
waits a quarter of the hello deadline (on its own thread) before its hello
is read, until the lockout ends.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time

from ...errors import BackendUnavailable, ControlPlaneError, PeerError
from ..base import BackendOptions, specific_options
from ..options import TcpOptions
from ..soft.dial import Expected, closed_on_failure
from .guard import DataGuard
from .pairstate import PairState
from .responder import Responder
from .wire import HELLO, HELLO_ACK, MAGIC, VERSION, HelloStatus, PeerGone, VendorErr, configure_data_socket

__all__ = ["Listener", "dial"]

log = logging.getLogger("moriio_async.tcp")

_WILDCARDS = ("", "0.0.0.0", "::")
_BACKLOG = 2048
"""The kernel's queue of connections not yet accepted: deep, so that under a crowd of connections a real dial
waits its turn in that queue (first come, first accepted) instead of having its SYN dropped and retried
seconds later, a lottery against the crowd's own retries (Linux clips it to ``net.core.somaxconn``)."""
_EVICTION_PAUSE = 0.00025
"""Seconds the accept thread waits after closing a connection in its hello to make room."""


class Listener:
    """The backend's data port: one accept thread, one thread per accepted connection."""

    def __init__(self, options: BackendOptions, guard: DataGuard) -> None:
        self.options = options
        self.own = specific_options(options, TcpOptions)
        self.guard = guard
        self._lock = threading.Lock()
        self._closed = False
        self._hellos: dict[Responder, tuple[str, float, bool]] = {}
        """Connections in their hello (each holds a thread), oldest first: remote address, accept time, and
        whether it had sent something at accept."""
        self.expected: Expected[PairState] = Expected()
        """Passive pairs expecting a dial, by token (each goes at its dial, or when its pair closes)."""
        self._threads: dict[Responder, threading.Thread] = {}
        family = socket.AF_INET6 if ":" in options.host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((options.host, 0))
            self._sock.listen(_BACKLOG)
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
        self._accept_thread = threading.Thread(target=self._accept_loop, name=f"moriio-tcp-accept-{self.port}")
        self._accept_thread.daemon = True
        self._accept_thread.start()

    @property
    def waiting(self) -> int:
        """Tokens of passive pairs not dialed yet (each goes at its dial, or when its pair closes)."""
        return len(self.expected)

    def close(self) -> None:
        """Stop accepting, end every connection and join every thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes accept()
        self._accept_thread.join()
        self._sock.close()
        with self._lock:
            threads = dict(self._threads)
        for responder in threads:
            responder.stop()
        for thread in threads.values():
            thread.join()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _addr = self._sock.accept()
            except OSError as exc:
                if self._closed:
                    return
                log.warning("tcp backend port %d: accept failed: %s", self.port, exc)
                time.sleep(0.05)  # e.g. EMFILE: do not spin
                continue
            host = _host(conn)
            talking = _talking(conn)
            responder = Responder(conn, self.guard, self.options.retry_timeout)
            thread = threading.Thread(target=self._connection, args=(responder,), daemon=True,
                                      name=f"moriio-tcp-resp-{self.port}")  # fmt: skip
            responder.thread = thread
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                evicted = self._make_room(host)
                self._hellos[responder] = (host, time.monotonic(), talking)
                self._threads[responder] = thread
            for victim, victim_host in evicted:
                victim.stop()  # wakes its thread, which finds it was evicted and leaves
                self.guard.evicted_hello(victim_host)
            thread.start()
            if evicted:
                # At most four evictions a millisecond: the threads of connections just accepted get to read
                # their hello (the GIL goes to them) before a flood of newcomers could push them out.
                time.sleep(_EVICTION_PAUSE)

    @property
    def _hello_deadline(self) -> float:
        return min(self.options.hello_timeout, self.options.connect_timeout)

    def _make_room(self, host: str) -> list[tuple[Responder, str]]:
        """Under the lock: take out of their hello the connections that must go for one from ``host`` (the
        caller stops them). Over ``max_data_hellos_per_address``: the oldest from ``host`` that had half its
        deadline. At ``max_data_hellos``: the oldest silent one (nothing had come by its accept; an honest
        dialer sends its hello at once), else the oldest."""
        ripe_since = time.monotonic() - self._hello_deadline / 2
        evicted: list[tuple[Responder, str]] = []

        def take(pick: list[Responder]) -> bool:
            if pick:
                evicted.append((pick[0], self._hellos.pop(pick[0])[0]))
            return bool(pick)

        if sum(h == host for h, _, _ in self._hellos.values()) >= self.own.max_data_hellos_per_address:
            take([r for r, (h, since, _) in self._hellos.items() if h == host and since <= ripe_since])
        if len(self._hellos) >= self.own.max_data_hellos:
            # Every one here has not got its whole hello in yet (it leaves the set as it does): the oldest
            # silent one goes (nothing at accept), else the oldest.
            silent = [r for r, (_, _, said) in self._hellos.items() if not said]
            take(silent or list(self._hellos))
        return evicted

    def _done_with_hello(self, responder: Responder) -> bool:
        """Its hello's bytes are all in (or it ended): out of the set; False if it was evicted meanwhile."""
        with self._lock:
            return self._hellos.pop(responder, None) is not None

    def _connection(self, responder: Responder) -> None:
        st: PairState | None = None
        try:
            try:
                st = self._answer(responder)
            finally:
                self._done_with_hello(responder)
            if st is not None:
                responder.serve(st)
        except PeerGone as exc:
            if exc.vendor == VendorErr.PEER_SILENT and st is not None and not responder.stopped:
                self.guard.slow_message(f"qp {st.qp_num}", "a chunk did not arrive whole within its deadline")
        except BaseException:
            log.exception("tcp responder on port %d failed", self.port)
        finally:
            responder.close()
            if st is not None:
                st.responder_done()
            with self._lock:
                self._threads.pop(responder, None)

    def _answer(self, responder: Responder) -> PairState | None:
        """The passive half of the hello, within one deadline: the token names a waiting pair, which
        takes the connection (and the token is gone)."""
        sock = responder.sock
        host = _host(sock)
        timeout = self._hello_deadline
        deadline = time.monotonic() + timeout
        hello = bytearray(HELLO.size)
        view = memoryview(hello)
        if self.guard.delayed(host) and not responder.pause(timeout / 4):  # a guesser's next try costs this
            return None
        try:
            while view:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.guard.slow_message(host, f"no whole hello within {timeout:g}s")
                    return None
                sock.settimeout(left)
                n = sock.recv_into(view)
                if not n:
                    return None
                view = view[n:]
            if not self._done_with_hello(responder):
                return None  # closed to make room just as its last byte came: it goes as it was told
            magic, version, _flags, token, _peer_qp = HELLO.unpack(hello)
            if magic != MAGIC:
                self.guard.bad_message(host, "not a moriio data-port hello")
                sock.sendall(HELLO_ACK.pack(MAGIC, VERSION, HelloStatus.BAD_HELLO, 0))
                return None
            if version != VERSION:
                self.guard.bad_message(host, f"wire version {version}, this side {VERSION}")
                sock.sendall(HELLO_ACK.pack(MAGIC, VERSION, HelloStatus.BAD_VERSION, 0))
                return None
            st = self.expected.claim(token)
            if st is None or not st.attach(responder):
                self.guard.refused_token(host)
                sock.sendall(HELLO_ACK.pack(MAGIC, VERSION, HelloStatus.UNKNOWN_TOKEN, 0))
                return None
            configure_data_socket(sock, self.options.retry_timeout)
            sock.sendall(HELLO_ACK.pack(MAGIC, VERSION, HelloStatus.OK, st.qp_num))
        except TimeoutError:
            self.guard.slow_message(host, f"no whole hello within {timeout:g}s")
            return None
        except OSError:
            return None
        return st


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
