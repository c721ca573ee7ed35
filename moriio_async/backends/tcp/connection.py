"""One accepted data connection's socket on the reactor: phases, resumable moves, deadlines, and how it ends.

A ``Connection`` is the I/O half of a responder (``responder.py`` is the
NIC's half: what a chunk asks, the checks, the pins). Its socket is
non-blocking and watched by the reactor's one thread (``reactor.py``); each
readiness runs ``pump``, which moves what the kernel has (or takes) now and
returns, so a slow or silent peer holds no thread. At most ``BUDGET`` socket
calls per readiness, then the other connections get their turn (epoll is
level-triggered, so what is left is reported again).

Phases: ``HEAD`` and ``DESCS`` (the responder reads a chunk's header and
descriptors: ``read_chunk``), ``PAYLOAD`` (``receive``: a WRITE's payloads
into pinned target ranges), ``SENDING`` (``send``: a response, a READ's
payloads from pinned ranges), ``HOOK`` (a fault hook runs elsewhere),
``DRAIN`` (``refuse_rest``), ``LINGER`` (``linger``), ``CLOSED``.

A chunk's deadline (``deadline``, set by the responder at its first byte and
extended for its payloads) is one timer per connection at a time, re-armed
when it fires early, so however a peer spaces its chunks the reactor's heap
holds at most one entry for it.

Threads: ``stop`` and ``abort`` come from any thread. Each takes ``_lock``
for a flag and a shutdown (never a region's lock: ``abort`` runs under one,
so the reactor's thread never takes a region's lock while holding
``_lock``); the shutdown makes the poll report the socket, and ``stop`` also
queues ``shutdown`` on the reactor. ``_lock`` also keeps a shutdown from
landing on a closed, reused fd.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Final

from .iov import MIN_RATE
from .pending import Pending
from .reactor import IN, OUT, Reactor, Timer
from .wire import VendorErr

__all__ = ["BUDGET", "CLOSED", "DESCS", "DRAIN", "HEAD", "HOOK", "LINGER", "PAYLOAD", "SENDING", "Connection"]

BUDGET: Final = 32
"""Socket calls one connection is served per readiness before the reactor turns to the others."""
HEAD, DESCS, PAYLOAD, SENDING, HOOK, DRAIN, LINGER, CLOSED = range(8)
SCRATCH = 1 << 16
_RECEIVING = (HEAD, DESCS, PAYLOAD)
_GONE: Final = select.EPOLLHUP | select.EPOLLERR
_LINGER_POLL: Final = 0.005
_HUNG_UP = frozenset({6, 7, 8, 9, 11})  # tcpi_state TIME_WAIT, CLOSE, CLOSE_WAIT, LAST_ACK, CLOSING: its FIN is in
_INF = float("inf")
_scratch = memoryview(bytearray(SCRATCH))  # bytes drained and dropped: shared, never read


class Connection:
    """The socket's side of one responder; ``read_chunk`` and ``ended`` are the responder's."""

    def __init__(self, sock: socket.socket, timeout: float, reactor: Reactor) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.timeout = timeout
        """The silence timeout (``retry_timeout``): also the base of each chunk's deadline."""
        self.reactor = reactor
        self.phase = HEAD
        self.deadline = _INF
        """When the chunk under way must be done (inf between chunks: an idle pair is not a dead one)."""
        self._lock = threading.Lock()
        self._stopped = False
        self._writes = False  # the chunk being served is WRITEs: its regions are pinned to receive into
        self._moving = False  # between pinning a chunk's regions and the end of its moves on them
        self._cut = False  # abort shut the socket during those moves: the connection cannot go on
        self._ended = threading.Event()
        self._timer: Timer | None = None
        self._budget = 0
        self._in: Pending | None = None
        self._on_received: Callable[[bool], None] | None = None
        self._out: Pending | None = None
        self._then: Callable[[], None] | None = None
        self._linger_until = 0.0

    # -- what the responder provides -------------------------------------------------------------------

    def read_chunk(self) -> bool:
        """In ``HEAD`` or ``DESCS``: read on; False once waiting (``wait``) or ended."""
        raise NotImplementedError

    def ended(self, vendor: VendorErr | None) -> None:
        """Service ended (the socket is closed): release what the chunk held, tell the pair."""

    # -- from any thread --------------------------------------------------------------------------------

    def stop(self) -> None:
        """End service: the socket is shut down now, the rest happens on the reactor."""
        with self._lock:
            self._stopped = True
            self._shut_locked(socket.SHUT_RDWR)
        self.reactor.call_soon(self.shutdown)

    def abort(self) -> None:
        """A region this connection's chunk holds is being deregistered: cut the moves on it now.

        A receive is ended with a read shutdown (the response can still go out,
        saying REM_ACCESS_ERR); a send, with both directions shut. Called under
        the region's lock, so the pin is still held. Once the moves have ended
        (its bytes are all in or out), nothing is shut: the chunk is answered as
        it went and the region is unpinned next, and service goes on unharmed.
        A shutdown then would leave a read-shut socket serving later chunks,
        whose refusal could be beaten by a reset (RETRY_EXC_ERR instead of
        REM_ACCESS_ERR).
        """
        with self._lock:
            if not self._moving:
                return
            self._cut = True
            self._shut_locked(socket.SHUT_RD if self._writes else socket.SHUT_RDWR)

    @property
    def stopped(self) -> bool:
        """``stop`` was called (the pair closed, or the backend): what ends service is not the peer's doing."""
        return self._stopped

    def join(self) -> None:
        """Wait until service ended (unless on the reactor's thread)."""
        if not self.reactor.on_thread():
            self._ended.wait()

    def _shut_locked(self, how: int) -> None:
        if self.sock.fileno() >= 0:  # under _lock: the reactor's close cannot have handed the fd on
            with contextlib.suppress(OSError):
                self.sock.shutdown(how)

    # -- on the reactor's thread -----------------------------------------------------------------------

    def moving_begins(self, writes: bool) -> None:
        """Before a chunk's regions are pinned: from now until ``moving_ends`` an abort shuts the socket."""
        with self._lock:
            self._moving = True
            self._writes = writes

    def moving_ends(self) -> bool:
        """The moves on the pinned regions ended; True if an abort cut the connection meanwhile (even
        moves that completed: the socket is shut, so the chunk is answered as aborted)."""
        with self._lock:
            self._moving = False
            return self._cut

    def ready(self, events: int) -> None:
        if events & _GONE and self.phase in (HOOK, LINGER):
            self.shutdown()  # watched for nothing else: a hang-up would be reported at every turn
            return
        self.pump()

    def shutdown(self, vendor: VendorErr | None = None) -> None:
        """End service and close the socket (idempotent)."""
        if self.phase == CLOSED:
            return
        self.phase = CLOSED
        self.moving_ends()
        self._in = self._out = None
        self._on_received = self._then = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.reactor.unwatch(self.fd)
        with self._lock:
            self.sock.close()
        self._ended.set()
        self.ended(vendor)

    def pump(self) -> None:
        """Move what can move now."""
        self._budget = BUDGET
        while self.phase != CLOSED and self._step():
            pass

    def _step(self) -> bool:
        """One move; False once it waits for readiness, a timer or a hook (or service ended)."""
        if self._out is not None:
            try:
                sent = self._out.send(self.sock, BUDGET)
            except OSError:
                self.shutdown()  # an abort's shutdown, or the peer reset
                return False
            if not sent:
                return self.wait(OUT)
            then, self._out, self._then = self._then, None, None
            assert then is not None
            then()
            return True
        if self._budget <= 0:
            return self.wait(IN)  # level-triggered: served again at the next turn
        self._budget -= 1
        phase = self.phase
        if phase in (HEAD, DESCS):
            return self.read_chunk()
        if phase == PAYLOAD:
            return self._read_payload()
        if phase == DRAIN:
            return self._drain()
        return self.wait(0)  # HOOK, LINGER: a call or a timer resumes it

    def wait(self, mask: int) -> bool:
        """Wait for ``mask`` readiness (and the chunk's deadline); False."""
        if self._stopped:
            self.shutdown()
            return False
        self.reactor.want(self.fd, mask)
        if self.deadline != _INF and self._timer is None and self.phase != HOOK:
            if self.deadline <= time.monotonic():
                self._expired()
            else:
                self._timer = self.reactor.call_at(self.deadline, self._expired)
        return False

    def _expired(self) -> None:
        self._timer = None
        if self.phase in (CLOSED, HOOK) or self.deadline == _INF:
            return  # after a hook, the next wait re-arms it
        if time.monotonic() < self.deadline:
            self._timer = self.reactor.call_at(self.deadline, self._expired)
            return
        self.shutdown(VendorErr.PEER_SILENT if self.phase in _RECEIVING else VendorErr.SEND_TIMEOUT)

    def recv(self, view: memoryview) -> int:
        """Bytes received into ``view``; 0 when nothing has come; -1 when the stream ended or broke."""
        try:
            n = self.sock.recv_into(view)
        except BlockingIOError:
            return 0
        except OSError:
            return -1
        return n or -1

    def send(self, pending: Pending, then: Callable[[], None]) -> None:
        """Send ``pending`` (from the next step on), then ``then``."""
        self._out, self._then = pending, then
        self.phase = SENDING

    def receive(self, pending: Pending, received: Callable[[bool], None]) -> None:
        """Receive ``pending`` (a WRITE's payloads: the deadline grows by them at ``MIN_RATE``), then
        ``received(aborted)``: aborted when a deregistration's ``abort`` cut it."""
        self._on_received = received
        if pending.left <= 0:
            received(self.moving_ends())
            return
        self.deadline += pending.left / MIN_RATE
        self._in = pending
        self.phase = PAYLOAD

    def _read_payload(self) -> bool:
        pending, received = self._in, self._on_received
        assert pending is not None
        assert received is not None
        if not self._cut:
            try:
                if not pending.recv(self.sock, BUDGET):
                    return self.wait(IN)
            except (EOFError, OSError):
                if not self._cut:  # not the abort's read shutdown: the peer went
                    self.shutdown(VendorErr.PEER_CLOSED)
                    return False
        self._in = self._on_received = None
        received(self.moving_ends())
        return True

    # -- after a refusal, after an abort -----------------------------------------------------------------

    def refuse_rest(self) -> None:
        """After an error response: execute nothing more, drain until the initiator hangs up (for at
        most one ``retry_timeout``: a peer that keeps sending does not keep the connection)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)
        self.phase = DRAIN
        self.deadline = time.monotonic() + self.timeout

    def _drain(self) -> bool:
        n = self.recv(_scratch)
        if n < 0:
            self.shutdown()
            return False
        return bool(n) or self.wait(IN)

    def linger(self) -> None:
        """After answering an aborted WRITE on a read-shut socket: wait (at most one ``retry_timeout``)
        for the initiator to hang up, taking in what it still sends, so that closing does not reset the
        connection before it read the answer (a reset would beat it as RETRY_EXC_ERR).

        No write shutdown here: Linux resets a connection that gets data after both of its directions
        were shut (FIN_WAIT with the read side shut), and the initiator is likely still sending the
        payloads of the WRITEs behind the aborted one. The answer makes it hang up. A read-shut socket is
        always readable, so this polls the connection's state on a timer instead of watching it."""
        self.phase = LINGER
        self.deadline = _INF
        self._linger_until = time.monotonic() + self.timeout
        self.reactor.want(self.fd, 0)
        self._lingering()

    def _lingering(self) -> None:
        if self.phase != LINGER:
            return
        if self._stopped or time.monotonic() >= self._linger_until:
            self.shutdown()
            return
        try:
            for _ in range(BUDGET):  # a read-shut socket returns what is queued, then 0
                if not self.sock.recv_into(_scratch, 0, socket.MSG_DONTWAIT):
                    break
            if self.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] in _HUNG_UP:
                self.shutdown()
                return
        except BlockingIOError:
            pass
        except OSError:
            self.shutdown()
            return
        self.reactor.call_at(time.monotonic() + _LINGER_POLL, self._lingering)
