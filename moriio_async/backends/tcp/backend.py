"""TcpBackend: a software NIC over TCP, and its data-plane listener.

Threads, per backend: one accept thread; per active queue pair: a sender and
a receiver (``sender.py``, ``receiver.py``); per accepted connection: one responder
(``responder.py``). None of them touches asyncio, so a peer serves one-sided
reads and writes of its memory while its event loop is busy or blocked. The
posting thread itself writes small requests when the sender is idle (the
doorbell); every copy of payload bytes happens inside a socket call, with
the GIL released.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import threading
from typing import Any, ClassVar

from ...errors import BackendUnavailable, EngineClosed, InvalidArgument
from ...status import Access
from ..base import Backend, BackendOptions, CompletionQueue, MemoryRegion, QueuePair
from ..softcq import SoftCompletionQueue as TcpCompletionQueue
from .faults import hooks_from
from .hooks import Hooks
from .qp import MAX_SEND_WR, MAX_SGE, TcpQueuePair
from .regions import RegionTable
from .responder import Responder

__all__ = ["TcpBackend"]

log = logging.getLogger("moriio_async.tcp")

_WILDCARDS = ("", "0.0.0.0", "::")


class TcpBackend(Backend):
    name: ClassVar[str] = "tcp"

    def __init__(self, options: BackendOptions) -> None:
        self.options = options
        self.hooks: Hooks | None = hooks_from(options.extra)
        """Fault-injection hooks given to every queue pair (``extra={"hooks": ...}`` or ``{"fault_plan": ...}``)."""
        self.regions = RegionTable()
        self._lock = threading.Lock()
        self._closed = False
        self._qp_numbers = itertools.count(0x10)
        self._qps: dict[int, TcpQueuePair] = {}
        self._waiting: dict[bytes, TcpQueuePair] = {}  # token -> passive pair expecting a dial
        self._responders: set[Responder] = set()
        self._cqs: list[TcpCompletionQueue] = []
        family = socket.AF_INET6 if ":" in options.host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((options.host, 0))
            self._listener.listen(128)
            self.port: int = self._listener.getsockname()[1]
            # Peers dial what endpoint() says: a wildcard bind advertises this host's address.
            wildcard = options.host in _WILDCARDS
            self.host = socket.gethostbyname(socket.gethostname()) if wildcard else options.host
        except OSError as exc:
            self._listener.close()
            raise BackendUnavailable(
                f"tcp backend: cannot listen on {options.host!r}: {exc}",
                hint="set BackendOptions.host (IOEngineConfig.host) to an address of this machine",
            ) from exc
        self._accept_thread = threading.Thread(target=self._accept_loop, name=f"moriio-tcp-accept-{self.port}")
        self._accept_thread.daemon = True
        self._accept_thread.start()

    # -- the contract -----------------------------------------------------------------

    def register_memory(self, buffer: memoryview, access: Access) -> MemoryRegion:
        self._check_open()
        return self.regions.register(buffer, access)

    def deregister_memory(self, region: MemoryRegion) -> None:
        """Invalidate the region. Waits while a socket call is moving its bytes right now
        (normally microseconds; against a stalled peer, until the pair gives up on it:
        one to two ``retry_timeout``s)."""
        self.regions.deregister(region)

    def create_cq(self, depth: int) -> CompletionQueue:
        self._check_open()
        cq = TcpCompletionQueue(depth)
        with self._lock:
            self._cqs.append(cq)
        return cq

    def create_qp(self, cq: CompletionQueue) -> QueuePair:
        if not isinstance(cq, TcpCompletionQueue):
            raise InvalidArgument("a tcp queue pair needs a tcp completion queue")
        with self._lock:
            self._check_open()
            qp = TcpQueuePair(self, cq, next(self._qp_numbers) & 0xFFFFFF, self.options)
            self._qps[qp.qp_num] = qp
        return qp

    def describe(self) -> dict[str, Any]:
        return {
            "backend": "tcp",
            "host": self.host,
            "data_port": self.port,
            "sq_depth": max(1, min(self.options.sq_depth, MAX_SEND_WR)),
            "max_sge": max(1, min(self.options.max_sge, MAX_SGE)),
            "retry_timeout": self.options.retry_timeout,
            "threads": "accept 1; per active qp: send + recv; per passive qp: 1 responder",
        }

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            qps = list(self._qps.values())
            cqs = list(self._cqs)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        self._accept_thread.join()
        self._listener.close()
        for qp in qps:
            qp.close()  # flushes what is outstanding, joins its threads
        with self._lock:
            responders = list(self._responders)
        for r in responders:
            r.stop()
        for r in responders:
            r.thread.join()
        for cq in cqs:
            cq.close()
        self.regions.clear()

    # -- used by queue pairs and responders ---------------------------------------------

    def expect(self, token: bytes, qp: TcpQueuePair) -> None:
        with self._lock:
            self._waiting[token] = qp

    def claim(self, token: bytes) -> TcpQueuePair | None:
        """The passive pair a dial's token names (each token is good for one dial)."""
        with self._lock:
            return self._waiting.pop(token, None)

    def forget(self, qp: TcpQueuePair) -> None:
        with self._lock:
            self._qps.pop(qp.qp_num, None)
            self._waiting.pop(qp.token, None)

    def responder_finished(self, responder: Responder) -> None:
        with self._lock:
            self._responders.discard(responder)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed("the tcp backend is closed")

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _addr = self._listener.accept()
            except OSError as exc:
                if self._closed:
                    return
                log.warning("tcp backend port %d: accept failed: %s", self.port, exc)
                threading.Event().wait(0.05)  # e.g. EMFILE: do not spin
                continue
            responder = Responder(self, conn)
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._responders.add(responder)
            responder.start()
