"""The queue pair: its state machine, send-queue slots, and in-order completion.

Posting appends to two deques under the pair's lock: ``_to_send`` (the
sender thread takes from it) and ``_inflight`` (the receiver thread completes
from its head, in order). Every completion is pushed to the CQ under the same
lock, so completions of one pair are in posting order whichever thread makes
them. The threads themselves live in ``sender.py`` and ``receiver.py``
(active side) and ``responder.py`` (passive side).

A request that will never touch the wire (a local protection error, or a
status chosen by a fault hook) is *preset*: it carries its outcome and
completes when it reaches the head of ``_inflight``, so it still completes in
order. The first failure puts the pair in ERR: the oldest outstanding request
gets the failure, the rest WR_FLUSH_ERR, and the connection is shut down.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ...errors import ControlPlaneError, InvalidArgument, PeerError
from ...status import Opcode, WcStatus
from ...work import WorkBatch, WorkCompletion, WorkRequest
from ..base import BackendOptions, Endpoint, QpState, QueuePair, SendQueueFull
from ..softcq import SoftCompletionQueue as TcpCompletionQueue
from .hooks import Hooks
from .receiver import recv_loop
from .regions import RegionTable, TcpRegion
from .sender import send_inline, send_loop
from .wire import HELLO, HELLO_ACK, MAGIC, SEQ_MASK, VERSION, HelloStatus, VendorErr, configure_data_socket

if TYPE_CHECKING:
    from .backend import TcpBackend
    from .responder import Responder

__all__ = ["TcpQueuePair"]

log = logging.getLogger("moriio_async.tcp")

MAX_SEND_WR = 1 << 16
MAX_SGE = 256  # one request's gather list must fit one sendmsg (IOV_MAX 1024) with room to batch
INLINE_BYTES = 64 << 10  # WRITE payload post_send may copy into the socket itself (on the caller's thread)
INLINE_IOV = 256


class Entry:
    """One posted request."""

    __slots__ = ("acked", "is_read", "length", "preset", "regions", "sent", "seq", "views", "wr")

    def __init__(self, wr: WorkRequest, seq: int, length: int) -> None:
        self.wr = wr
        self.seq = seq
        self.length = length
        self.is_read = wr.opcode is Opcode.RDMA_READ
        self.sent = False  # set by the sender before the request is written; never unset
        self.acked = False  # the target answers it (set with ``sent``; a READ always is)
        self.preset: tuple[WcStatus, int] | None = None
        self.views: list[memoryview] = []
        self.regions: list[TcpRegion] = []


class TcpQueuePair(QueuePair):
    def __init__(self, backend: TcpBackend, cq: TcpCompletionQueue, qp_num: int, options: BackendOptions) -> None:
        self.qp_num = qp_num
        self.max_send_wr = max(1, min(options.sq_depth, MAX_SEND_WR))
        self.max_sge = max(1, min(options.max_sge, MAX_SGE))
        self.hooks: Hooks | None = backend.hooks
        self.token = secrets.token_bytes(16)
        self.remote: dict[str, object] = {}
        self._backend = backend
        self._options = options
        self._cq = cq
        self.lock = threading.Lock()
        self.send_cv = threading.Condition(self.lock)
        self.recv_cv = threading.Condition(self.lock)
        # Held by the receiver while it writes a READ response into local memory;
        # the error path waits for it so no byte lands after a flush is visible.
        self.rx_lock = threading.Lock()
        # Held by whoever writes requests to the socket: the sender thread, or post_send
        # ringing the doorbell itself (it only ever tries it, never waits for it).
        self.tx_lock = threading.Lock()
        self.tx_pending: tuple[list[bytes | memoryview], int, list[TcpRegion]] | None = None
        """Gather list, bytes, pinned regions: a doorbell write the socket took only part of."""
        self.send_stopped = False  # a request failed locally: nothing after it is sent
        self._state = QpState.INIT
        self._passive = False
        self._closed = False
        self.to_send: deque[Entry] = deque()
        self.inflight: deque[Entry] = deque()
        self._next_seq = 0
        self._posted = 0  # written under _lock by post_send
        self._released = 0  # written under the CQ's lock by poll (release_slots)
        self._uncovered = 0  # successful unsignaled requests the next completion covers
        self._sock: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._responder: Responder | None = None

    # -- the contract -----------------------------------------------------------------

    @property
    def state(self) -> str:
        return self._state

    def endpoint(self) -> Endpoint:
        return {
            "backend": "tcp",
            "host": self._backend.host,
            "port": self._backend.port,
            "qp_num": self.qp_num,
            "token": self.token.hex(),
            # True once connect() made this the passive side: the peer then dials it.
            "accepting": self._passive,
        }

    def connect(self, remote: Endpoint) -> None:
        if remote.get("backend") != "tcp":
            raise InvalidArgument(f"not a tcp queue-pair endpoint: {dict(remote)!r}")
        with self.lock:
            if self._closed or self._state != QpState.INIT:
                raise InvalidArgument(f"connect needs a queue pair in INIT (qp {self.qp_num} is {self._state})")
            self.remote = dict(remote)
            if not remote.get("accepting"):
                # Passive side: the active pair will dial us with our token.
                self._passive = True
                self._state = QpState.RTS
                self._backend.expect(self.token, self)
                return
        sock = self._dial(remote)
        with self.lock:
            if self._closed or self._state != QpState.INIT:
                sock.close()
                raise InvalidArgument(f"qp {self.qp_num} was closed while connecting")
            self._sock = sock
            self._state = QpState.RTS
            self._threads = self._start_threads(sock)

    def post(self, batch: WorkBatch) -> None:
        # Transitional: the per-request path below, until this backend posts batches natively.
        self.post_send(batch.requests())

    def post_send(self, wrs: Sequence[WorkRequest]) -> None:
        n = len(wrs)
        with self.lock:
            state = self._state
            if self._passive or self._closed or state not in (QpState.RTS, QpState.ERR):
                raise InvalidArgument(
                    f"qp {self.qp_num} cannot post: "
                    + ("the passive pair only answers" if self._passive else f"it is {state}")
                    + (" and closed" if self._closed else "")
                )
            used = self._posted - self._released
            if used + n > self.max_send_wr:
                raise SendQueueFull(f"{n} requests, {self.max_send_wr - used} free slots of {self.max_send_wr}")
            entries = []
            seq = self._next_seq
            for wr in wrs:
                if len(wr.sges) > self.max_sge:
                    raise InvalidArgument(f"{len(wr.sges)} SGEs, qp {self.qp_num} takes at most {self.max_sge}")
                if wr.opcode is not Opcode.RDMA_WRITE and wr.opcode is not Opcode.RDMA_READ:
                    raise InvalidArgument(f"unsupported opcode {wr.opcode!r}")
                entries.append(Entry(wr, seq & SEQ_MASK, wr.length))
                seq += 1
            self._next_seq = seq
            self._posted += n
            if state == QpState.ERR:
                # Accepted and flushed at once, as verbs does on a pair in the error state.
                for e in entries:
                    self._push_locked(e, WcStatus.WR_FLUSH_ERR, 0)
                return
            if not self.inflight:
                self.recv_cv.notify()
            self.inflight.extend(entries)
            idle = not self.to_send
            self.to_send.extend(entries)
            if (
                idle
                and self.hooks is None
                and self.tx_pending is None
                and not self.send_stopped
                and sum(0 if e.is_read else e.length for e in entries) <= INLINE_BYTES
                and sum(1 + len(e.wr.sges) for e in entries) <= INLINE_IOV
                and self.tx_lock.acquire(blocking=False)
            ):
                try:
                    assert self._sock is not None
                    send_inline(self, self._sock)
                finally:
                    self.tx_lock.release()
                if self.tx_pending is None and not self.to_send:
                    return
            self.send_cv.notify()

    def to_error(self) -> None:
        with self.lock:
            self.fail_locked(WcStatus.WR_FLUSH_ERR, 0)

    def close(self) -> None:
        with self.lock:
            if self._closed:
                return
            self._closed = True
            self.fail_locked(WcStatus.WR_FLUSH_ERR, 0)
            threads, sock, responder = self._threads, self._sock, self._responder
        self._backend.forget(self)
        current = threading.current_thread()
        if responder is not None:
            responder.stop()
            if responder.thread is not current:
                responder.thread.join()
        for t in threads:
            if t is not current:
                t.join()
        if sock is not None:
            sock.close()

    # -- used by the CQ, the NIC threads and the backend --------------------------------
    # ``lock`` guards the state, both deques and the counters; ``send_cv`` and
    # ``recv_cv`` (on that lock) wake the sender and the receiver.

    @property
    def regions(self) -> RegionTable:
        return self._backend.regions

    def release_slots(self, n: int) -> None:
        self._released += n

    def attach(self, responder: Responder) -> bool:
        """The dial carrying our token arrived; False if this pair is gone meanwhile."""
        with self.lock:
            if self._closed or self._state != QpState.RTS or self._responder is not None:
                return False
            self._responder = responder
            return True

    def responder_done(self) -> None:
        """The passive pair's connection ended: the pair is unusable from now on."""
        with self.lock:
            self._state = QpState.ERR

    def _push_locked(self, e: Entry, status: WcStatus, vendor: int) -> None:
        slots = self._uncovered + 1
        self._uncovered = 0
        byte_len = e.length if status is WcStatus.SUCCESS else 0
        self._cq.push(WorkCompletion(e.wr.wr_id, status, e.wr.opcode, byte_len, self.qp_num, vendor), self, slots)

    def complete_ok_locked(self, e: Entry) -> None:
        if e.wr.signaled:
            self._push_locked(e, WcStatus.SUCCESS, 0)
        else:
            self._uncovered += 1

    def drain_presets_locked(self) -> None:
        inflight = self.inflight
        while inflight:
            preset = inflight[0].preset
            if preset is None:
                return
            status, vendor = preset
            if status is not WcStatus.SUCCESS:
                self.fail_locked(status, vendor)
                return
            self.complete_ok_locked(inflight.popleft())

    def preset(self, e: Entry, status: WcStatus, vendor: int) -> None:
        """Give ``e`` its outcome without the wire; it completes when it reaches the head."""
        with self.lock:
            self.preset_locked(e, status, vendor)

    def preset_locked(self, e: Entry, status: WcStatus, vendor: int) -> None:
        if self._state != QpState.RTS:
            return
        e.preset = (status, vendor)
        self.drain_presets_locked()

    def peer_lost(self, vendor: VendorErr) -> None:
        with self.lock:
            if self._state == QpState.RTS:
                self.fail_locked(WcStatus.RETRY_EXC_ERR, vendor)

    def fail(self, status: WcStatus, vendor: int) -> None:
        with self.lock:
            self.fail_locked(status, vendor)

    def fail_locked(self, status: WcStatus, vendor: int) -> None:
        """Enter ERR: the oldest outstanding request gets ``status``, the rest WR_FLUSH_ERR."""
        if self._state == QpState.ERR:
            return
        self._state = QpState.ERR
        self.send_cv.notify_all()
        self.recv_cv.notify_all()
        if self._responder is not None:
            self._responder.stop()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes both threads; the peer sees the end
            # The receiver may be scattering a READ response into local memory right now;
            # the shutdown makes that call return, and no flush is reported before it has.
            with self.rx_lock:
                pass
        entries, self.inflight = self.inflight, deque()
        self.to_send.clear()
        for e in entries:
            self._push_locked(e, status, vendor)
            status, vendor = WcStatus.WR_FLUSH_ERR, 0

    def _start_threads(self, sock: socket.socket) -> list[threading.Thread]:
        threads = [
            threading.Thread(target=self._guard, args=(send_loop, sock), name=f"moriio-tcp-send-{self.qp_num}"),
            threading.Thread(target=self._guard, args=(recv_loop, sock), name=f"moriio-tcp-recv-{self.qp_num}"),
        ]
        for t in threads:
            t.daemon = True
            t.start()
        return threads

    def _guard(self, loop: Callable[[TcpQueuePair, socket.socket], None], sock: socket.socket) -> None:
        """Run a NIC loop; an unexpected error becomes completions, never a thread exception."""
        try:
            loop(self, sock)
        except BaseException:
            log.exception("tcp qp %d: NIC thread failed", self.qp_num)
            self.fail(WcStatus.GENERAL_ERR, 0)

    def _dial(self, remote: Endpoint) -> socket.socket:
        """Open the data connection to the passive pair and present its token."""
        try:
            host, port, token = str(remote["host"]), int(remote["port"]), bytes.fromhex(str(remote["token"]))
        except (KeyError, ValueError, TypeError) as exc:
            raise InvalidArgument(f"malformed tcp endpoint {dict(remote)!r}: {exc}") from exc
        deadline = time.monotonic() + self._options.connect_timeout
        where = f"{host}:{port}"
        try:
            sock = socket.create_connection((host, port), timeout=self._options.connect_timeout)
        except OSError as exc:
            raise ControlPlaneError(
                f"qp {self.qp_num}: cannot open the data connection to {where}: {exc}",
                hint="check that the peer's backend is up and its data port is reachable",
            ) from exc
        try:
            sock.sendall(HELLO.pack(MAGIC, VERSION, 0, token, self.qp_num))
            ack = bytearray(HELLO_ACK.size)
            view = memoryview(ack)
            while view:
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                n = sock.recv_into(view)
                if not n:
                    raise ConnectionResetError("connection closed during the handshake")
                view = view[n:]
            magic, version, status, _peer_qp = HELLO_ACK.unpack(ack)
            if magic != MAGIC or version != VERSION:
                raise ControlPlaneError(f"qp {self.qp_num}: {where} is not a moriio tcp data port (v{VERSION})")
            if status != HelloStatus.OK:
                raise PeerError(
                    f"qp {self.qp_num}: {where} refused the queue-pair token ({HelloStatus(status).name})",
                    hint="the passive pair was closed or its engine restarted; exchange endpoints again",
                )
            configure_data_socket(sock, self._options.retry_timeout)
        except OSError as exc:
            sock.close()
            raise ControlPlaneError(f"qp {self.qp_num}: handshake with {where} failed: {exc}") from exc
        except BaseException:
            sock.close()
            raise
        return sock
