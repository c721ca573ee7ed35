"""The passive side: one accepted data connection's state machine, playing the target's NIC.

Requests arrive as chunks (``wire.py``). A chunk's remote ranges are checked
together (rkey, bounds, access, region alive: ``RegionTable.check_remote``)
and its target regions pinned; a WRITE chunk's payloads are received with
``recvmsg`` straight into the target regions, a READ chunk's response header
and payloads go out with ``sendmsg`` straight from them. A violation touches
no target byte: the requests before it run, the response says REM_ACCESS_ERR
for it, and service on the connection ends (the rest of the stream is
drained, for at most ``retry_timeout``), as a verbs responder's QP enters the
error state; the refusal is counted and reported (``DataGuard.access_error``).

Every connection is served by the reactor's one thread (``reactor.py``) on a
non-blocking socket (``connection.py``: its phases, resumable moves, the
drain and the linger): a partial header, descriptor list, payload or
response resumes at the next readiness, so a slow or silent peer holds no
thread. A pair with fault hooks runs them on a thread of its own for that
connection (hooks may sleep or block), never on the reactor's.

Every chunk has one total deadline from its first byte to its response's
last (``retry_timeout`` plus its payload at ``MIN_RATE``), a timer on the
reactor, so a peer that spaces its bytes out cannot hold a pinned region for
longer. Deregistering a region this responder is receiving into or sending
from calls ``abort`` (``regions.Abortable``, from the deregistering thread,
under the region's lock): the socket is shut down, which the reactor sees as
readiness; the region is unpinned there, and an aborted WRITE is answered
with REM_ACCESS_ERR (REMOTE_DEREGISTERED) before service ends. Lock order: a
region's lock, then the connection's; the reactor's thread holds the
connection's only for a few statements and never while pinning or unpinning,
and never waits for a region to drain.
"""

from __future__ import annotations

import functools
import logging
import queue
import socket
import struct
import time
from collections.abc import Callable

import numpy as np

from ...status import Opcode, WcStatus
from .connection import CLOSED, DESCS, HEAD, HOOK, SENDING, Connection
from .guard import DataGuard
from .hooks import Fault
from .iov import address, iovecs
from .pairstate import PairState
from .pending import Pending
from .reactor import IN, Reactor
from .regions import Checked
from .wire import CHUNK, DESC, MAX_CHUNK, RESPONSE, SEQ_MASK, VendorErr

__all__ = ["Responder"]

log = logging.getLogger("moriio_async.tcp")

_WRITE = int(Opcode.RDMA_WRITE)
_READ = int(Opcode.RDMA_READ)
_REM_ACCESS_ERR = int(WcStatus.REM_ACCESS_ERR)
_DEREGISTERED = int(VendorErr.REMOTE_DEREGISTERED)
_FIRST = CHUNK.size + DESC.itemsize  # a chunk header and its first descriptor: read with one call
_DESC1 = struct.Struct("<IIQQ")


class Responder(Connection):
    """One accepted connection serving ``st``, on ``reactor``'s thread (``start`` hands it the socket);
    ``stop`` and ``abort`` from anywhere."""

    def __init__(self, sock: socket.socket, st: PairState, guard: DataGuard, timeout: float, reactor: Reactor) -> None:
        super().__init__(sock, timeout, reactor)
        self.st = st
        self.guard = guard
        self._head = memoryview(bytearray(_FIRST))
        self._got = 0
        self._descs: np.ndarray | None = None
        self._checked: Checked | None = None
        self._op = self._seq = self._count = self._done = 0
        self._reply = (0, 0, 0, 0)  # a WRITE's response once its payloads are in: seq, done, status, vendor
        self._after: Callable[[], None] = self._chunk_end
        self._hooks: queue.SimpleQueue[_Job | None] | None = None

    def start(self, ack: bytes) -> None:
        """On the reactor's thread: send the hello's ``ack``, then serve chunks (unless stopped already)."""
        if self.phase == CLOSED:
            return
        self.send(Pending(len(ack), [ack]), self._next_chunk)
        self.reactor.watch(self.fd, self, 0)
        self.pump()

    def ended(self, vendor: VendorErr | None) -> None:
        self._unpin()
        if self._hooks is not None:
            self._hooks.put(None)
        if vendor is VendorErr.PEER_SILENT and not self.stopped:
            self.guard.slow_message(f"qp {self.st.qp_num}", "a chunk did not arrive whole within its deadline")
        self.st.responder_done()

    def read_chunk(self) -> bool:
        return self._read_head() if self.phase == HEAD else self._read_descs()

    # -- a chunk ------------------------------------------------------------------------------------------

    def _next_chunk(self) -> None:
        self.phase = HEAD
        self._got = 0
        self._descs = None
        self.deadline = float("inf")

    def _read_head(self) -> bool:
        n = self.recv(self._head[self._got :])
        if n <= 0:
            if n < 0:
                self.shutdown(VendorErr.PEER_CLOSED if self._got else None)
                return False
            return self.wait(IN)
        if not self._got:  # its first bytes: the whole chunk is due within one deadline from now
            self.deadline = time.monotonic() + self.timeout
        self._got += n
        if self._got < _FIRST:
            return True
        op, _flags, _r16, seq, count, _r32 = CHUNK.unpack_from(self._head)
        if (op != _WRITE and op != _READ) or not 1 <= count <= MAX_CHUNK:
            self.guard.bad_message(
                _host(self.sock), f"qp {self.st.qp_num}: malformed chunk (opcode {op}, {count} requests)"
            )
            self.shutdown()
            return False
        self._op, self._seq, self._count = op, seq, count
        if count == 1:
            rkey, _r, addr, length = _DESC1.unpack_from(self._head, CHUNK.size)
            self._one(rkey, addr, length)
            return True
        descs = np.empty(count, dtype=DESC)
        raw = descs.data.cast("B")
        raw[: DESC.itemsize] = self._head[CHUNK.size :]
        self._descs = descs
        self._got = DESC.itemsize
        self.phase = DESCS
        return True

    def _read_descs(self) -> bool:
        descs = self._descs
        assert descs is not None
        raw = descs.data.cast("B")
        n = self.recv(raw[self._got :])
        if n <= 0:
            if n < 0:
                self.shutdown(VendorErr.PEER_CLOSED)
                return False
            return self.wait(IN)
        self._got += n
        if self._got == len(raw):
            self._many(descs)
        return True

    def _one(self, rkey: int, addr: int, length: int) -> None:
        """A one-request chunk, on plain integers: a fault hook first, if any."""
        hooks = self.st.hooks
        if hooks is None:
            self._one_checked(rkey, addr, length)
        elif self._op == _WRITE:
            self._hooked_writes([(rkey, 0, addr, length)], 0)
        else:
            qp, op = self.st.qp_num, self._op
            self._hook(lambda: hooks.on_request(qp, op, rkey, addr, length) is not Fault.DROP,
                       lambda: self._one_checked(rkey, addr, length))  # fmt: skip

    def _one_checked(self, rkey: int, addr: int, length: int) -> None:
        if self.stopped:
            self.shutdown()
            return
        op, seq = self._op, self._seq
        self.moving_begins(op == _WRITE)
        checked = self.st.regions.check_remote_one(op, rkey, addr, length, self)
        if not checked.first_bad:
            self.moving_ends()  # nothing pinned: no abort can come for it
            self._refused(op, rkey, addr, length, checked.vendor)
            self._respond((seq, 0, _REM_ACCESS_ERR, int(checked.vendor)), self.refuse_rest)
            return
        self._checked = checked
        self._done = 1
        region = checked.found[0]
        assert region is not None
        view = region.view[addr - region.addr : addr - region.addr + length]
        if op == _WRITE:
            self._receive(Pending(length, [view]), (seq, 1, 0, 0), self._chunk_end)
        else:
            head = RESPONSE.pack(op, 0, 0, seq, 1, 0, length)
            self.send(Pending(RESPONSE.size + length, [head, view]), self._read_sent)

    def _many(self, d: np.ndarray) -> None:
        op, count, hooks = self._op, self._count, self.st.hooks
        if hooks is not None and op == _WRITE:
            self._hooked_writes([tuple(int(x) for x in row) for row in d.tolist()], 0)
            return
        if self.stopped:
            self.shutdown()
            return
        self.moving_begins(op == _WRITE)
        checked = self.st.regions.check_remote(op, d["rkey"], d["addr"], d["length"], self)
        self._checked = checked
        done = self._done = checked.first_bad
        status, vendor = (0, 0) if done == count else (_REM_ACCESS_ERR, int(checked.vendor))
        if done < count:
            rkey, _r, addr, length = (int(x) for x in d[done].tolist())
            self._refused(op, rkey, addr, length, checked.vendor)
        if hooks is None:
            self._many_go(d, status, vendor)
            return
        # A READ chunk with hooks: every request it reaches, in order.
        reached = [tuple(int(x) for x in d[i].tolist()) for i in range(min(done + 1, count))]
        qp = self.st.qp_num

        def calls() -> bool:
            for rkey, _r, addr, length in reached:
                if hooks.on_request(qp, op, rkey, addr, length) is Fault.DROP or self.stopped:
                    return False
            return True

        self._hook(calls, lambda: self._many_go(d, status, vendor))

    def _many_go(self, d: np.ndarray, status: int, vendor: int) -> None:
        op, seq, done = self._op, self._seq, self._done
        if op == _WRITE:
            iov = iovecs(done)
            total = _fill(d, done, iov, 0)
            self._receive(Pending(total, iov=iov), (seq, done, status, vendor), self._chunk_end)
            return
        iov = iovecs(1 + done)
        payload = _fill(d, done, iov, 1)
        reply = np.zeros(RESPONSE.size, dtype=np.uint8)
        RESPONSE.pack_into(reply.data, 0, op, status, vendor, seq, done, 0, payload)
        iov[0] = (address(reply), RESPONSE.size)
        self.send(Pending(RESPONSE.size + payload, iov=iov, keep=reply), self._read_sent)

    def _hooked_writes(self, reqs: list[tuple[int, ...]], i: int) -> None:
        """A WRITE chunk on a hooked pair: ``on_request`` before each request, one response each."""
        if i == len(reqs):
            self._next_chunk()
            return
        hooks, qp = self.st.hooks, self.st.qp_num
        rkey, _r, addr, length = reqs[i]
        assert hooks is not None
        self._hook(lambda: hooks.on_request(qp, _WRITE, rkey, addr, length) is not Fault.DROP,
                   lambda: self._hooked_write(reqs, i))  # fmt: skip

    def _hooked_write(self, reqs: list[tuple[int, ...]], i: int) -> None:
        if self.stopped:
            self.shutdown()
            return
        rkey, _r, addr, length = reqs[i]
        here = (self._seq + i) & SEQ_MASK
        self.moving_begins(True)
        checked = self.st.regions.check_remote_one(_WRITE, rkey, addr, length, self)
        if not checked.first_bad:
            self.moving_ends()  # nothing pinned: no abort can come for it
            self._refused(_WRITE, rkey, addr, length, checked.vendor)
            self._respond((here, 0, _REM_ACCESS_ERR, int(checked.vendor)), self.refuse_rest)
            return
        self._checked = checked
        region = checked.found[0]
        assert region is not None
        view = region.view[addr - region.addr : addr - region.addr + length]
        self._receive(Pending(length, [view]), (here, 1, 0, 0), lambda: self._hooked_writes(reqs, i + 1))

    def _receive(self, pending: Pending, reply: tuple[int, int, int, int], after: Callable[[], None]) -> None:
        """Receive a WRITE's payloads into their pinned target ranges, then answer ``reply`` and go on ``after``."""
        self._reply, self._after = reply, after
        self.receive(pending, self._received)

    def _received(self, aborted: bool) -> None:
        self._unpin()  # before answering: the region's deregistration must not wait for the answer
        seq, done, status, vendor = self._reply
        if aborted:
            self.guard.aborted_receive(self.st.qp_num)
            self._respond((seq, 0, _REM_ACCESS_ERR, _DEREGISTERED), self.linger)
            return
        self._respond((seq, done, status, vendor), self._after)

    def _respond(self, reply: tuple[int, int, int, int], then: Callable[[], None]) -> None:
        """A response with no payload (a WRITE's, or a refusal)."""
        seq, done, status, vendor = reply
        head = RESPONSE.pack(self._op, status, vendor, seq, done, 0, 0)
        self.send(Pending(RESPONSE.size, [head]), then)

    def _read_sent(self) -> None:
        cut = self.moving_ends()  # sent whole, but if the socket is shut, service ends
        self._unpin()
        if cut:
            self.shutdown()
            return
        self._chunk_end()

    def _chunk_end(self) -> None:
        if self._done < self._count:
            self.refuse_rest()
        else:
            self._next_chunk()

    def _unpin(self) -> None:
        checked, self._checked = self._checked, None
        if checked is not None:
            checked.unpin()

    # -- refusals and fault hooks ---------------------------------------------------------------------------

    def _refused(self, op: int, rkey: int, addr: int, length: int, vendor: VendorErr) -> None:
        what = "WRITE" if op == _WRITE else "READ"
        detail = f"{what} rkey {rkey:#x} [{addr:#x}, +{length}): {vendor.name}"
        guess = vendor is not VendorErr.REMOTE_DEREGISTERED  # a stale region is the target's doing, not a guess
        self.guard.access_error(self.st.qp_num, _host(self.sock), detail, guess=guess)

    def _hook(self, call: Callable[[], bool], then: Callable[[], None]) -> None:
        """Run ``call`` (hooks may sleep or block to stall the peer) on this connection's hook thread,
        then ``then`` back here unless it said to drop the connection. Only pairs with hooks have one."""
        self.phase = HOOK
        self.reactor.want(self.fd, 0)
        if self._hooks is None:
            self._hooks = queue.SimpleQueue()
            name = f"moriio-tcp-hooks-{self.st.qp_num}"
            self.reactor.spawn(functools.partial(_run_hooks, self._hooks, self.reactor), name)
        self._hooks.put((call, lambda go: self._hooked(go, then)))

    def _hooked(self, go: bool, then: Callable[[], None]) -> None:
        if self.phase != HOOK:
            return  # ended meanwhile
        if not go or self.stopped:
            self.shutdown()
            return
        self.phase = SENDING  # neither waiting nor reading: ``then`` sets what comes next
        then()
        self.pump()


_Job = tuple[Callable[[], bool], Callable[[bool], None]]
"""A hook call (False: drop the connection) and what follows it on the reactor's thread."""


def _run_hooks(jobs: queue.SimpleQueue[_Job | None], reactor: Reactor) -> None:
    """A hooked connection's hook thread: each hook call, then its continuation on the reactor."""
    while (job := jobs.get()) is not None:
        call, resume = job
        try:
            go = call()
        except Exception:
            log.exception("tcp fault hook failed")
            go = False
        reactor.call_soon(functools.partial(resume, go))


def _fill(d: np.ndarray, n: int, iov: np.ndarray, row: int) -> int:
    """Point ``iov[row:row + n]`` at the target ranges of the first ``n`` descriptors; their bytes."""
    if n == 1:
        addr, length = int(d["addr"][0]), int(d["length"][0])
        iov[row] = (addr, length)
        return length
    if n:
        iov[row : row + n, 0] = d["addr"][:n]
        iov[row : row + n, 1] = d["length"][:n]
        return int(d["length"][:n].sum())
    return 0


def _host(sock: socket.socket) -> str:
    try:
        return str(sock.getpeername()[0])
    except OSError:
        return "?"
