"""One accepted data connection in its hello, on the reactor's thread: read it, check it, hand the socket on.

The hello (``wire.HELLO``, 28 bytes) must arrive whole within the hello
deadline from the accept, however its bytes are spaced: a timer, armed at
the accept. A connection from a source over its budget of failed guesses
waits a quarter of that deadline before its hello is read: a timer too,
never a sleep on the shared thread. A whole hello leaves the set of
connections in their hello (``HelloDesk.hello_in``) before its token is
looked up; a good token names a waiting pair, which takes the connection: a
``Responder`` sends the ack and serves it from then on, on the same fd.
A bad one is answered (best effort: 12 bytes into an empty socket buffer)
and the connection closed.
"""

from __future__ import annotations

import contextlib
import functools
import socket
import time
from typing import Protocol

from .guard import DataGuard
from .pairstate import PairState
from .reactor import IN, Reactor, Timer
from .responder import Responder
from .wire import HELLO, HELLO_ACK, MAGIC, VERSION, HelloStatus

__all__ = ["Greeting", "HelloDesk"]

_REFUSAL = int(socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)


class HelloDesk(Protocol):
    """What a connection in its hello needs from the listener."""

    def hello_in(self, greeting: Greeting) -> None:
        """Its hello's bytes are all in (or it ended): out of the set of connections in their hello."""

    def claim(self, token: bytes) -> PairState | None:
        """The passive pair ``token`` names, once."""

    def shard(self) -> Reactor:
        """The reactor to serve one more connection (the one serving the fewest)."""


class Greeting:
    """An accepted connection until its hello is answered (on the reactor's thread)."""

    __slots__ = ("_buf", "_desk", "_got", "_timers", "deadline", "guard", "host", "reactor", "retry_timeout", "sock")

    def __init__(
        self, sock: socket.socket, host: str, desk: HelloDesk, reactor: Reactor, guard: DataGuard, deadline: float,
        retry_timeout: float,
    ) -> None:  # fmt: skip
        self.sock = sock
        self.host = host
        self.reactor = reactor
        self.guard = guard
        self.deadline = deadline
        """Seconds from the accept for the whole hello."""
        self.retry_timeout = retry_timeout
        self._desk = desk
        self._buf = memoryview(bytearray(HELLO.size))
        self._got = 0
        self._timers: list[Timer] = []

    def start(self, delayed: bool) -> None:
        """Just accepted: the deadline starts now; ``delayed``: its source is over its budget, so its
        hello is read only after a quarter of the deadline."""
        now = time.monotonic()
        self._timers.append(self.reactor.call_at(now + self.deadline, self._too_slow))
        if delayed:
            self._timers.append(self.reactor.call_at(now + self.deadline / 4, self._listen))
        else:
            self._listen()

    def _listen(self) -> None:
        self.reactor.watch(self.sock.fileno(), self, IN)
        self.ready(IN)  # an honest dialer's hello is usually in by the accept

    def _too_slow(self) -> None:
        self.guard.slow_message(self.host, f"no whole hello within {self.deadline:g}s")
        self.shutdown()

    def shutdown(self) -> None:
        """Close it (evicted to make room, too slow, refused, or the backend closing). Idempotent."""
        if self.sock.fileno() < 0:
            return
        for timer in self._timers:
            timer.cancel()
        self.reactor.unwatch(self.sock.fileno())
        self.sock.close()
        self._desk.hello_in(self)

    def ready(self, events: int) -> None:
        try:
            n = self.sock.recv_into(self._buf[self._got :])
        except BlockingIOError:
            return
        except OSError:
            self.shutdown()
            return
        if not n:
            self.shutdown()
            return
        self._got += n
        if self._got < HELLO.size:
            return
        for timer in self._timers:
            timer.cancel()
        self._desk.hello_in(self)  # all in: never closed to make room from now on
        self._answer(bytes(self._buf))

    def _answer(self, hello: bytes) -> None:
        magic, version, _flags, token, _peer_qp = HELLO.unpack(hello)
        if magic != MAGIC:
            self.guard.bad_message(self.host, "not a moriio data-port hello")
            self._refuse(HelloStatus.BAD_HELLO)
            return
        if version != VERSION:
            self.guard.bad_message(self.host, f"wire version {version}, this side {VERSION}")
            self._refuse(HelloStatus.BAD_VERSION)
            return
        st = self._desk.claim(token)
        if st is None:
            self.guard.refused_token(self.host)
            self._refuse(HelloStatus.UNKNOWN_TOKEN)
            return
        shard = self._desk.shard()
        if shard is not self.reactor:
            # Another reactor's thread serves it from now on: this one lets go of the fd before the pair
            # takes the responder, whose stop (from any thread) may close the socket from then on.
            self.reactor.unwatch(self.sock.fileno())
        responder = Responder(self.sock, st, self.guard, self.retry_timeout, shard)
        if not st.attach(responder):
            self.guard.refused_token(self.host)
            self._refuse(HelloStatus.UNKNOWN_TOKEN)
            return
        with contextlib.suppress(OSError):  # the peer is gone: the responder finds out at its first call
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ack = HELLO_ACK.pack(MAGIC, VERSION, HelloStatus.OK, st.qp_num)
        if shard is self.reactor:
            responder.start(ack)  # takes the fd over
        else:  # the shards stop after this reactor, so this is never refused; a stop that came first wins
            shard.call_soon(functools.partial(responder.start, ack))

    def _refuse(self, status: HelloStatus) -> None:
        with contextlib.suppress(OSError):
            self.sock.send(HELLO_ACK.pack(MAGIC, VERSION, status, 0), _REFUSAL)
        self.shutdown()
