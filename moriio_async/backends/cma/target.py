"""The target's side: the backend's Unix socket, one thread per initiator, revocations and their acks.

A passive queue pair waits on a token (``expect``); the initiator dials the
backend's abstract Unix socket and presents it. The kernel names the caller
(``SO_PEERCRED``): a different uid is refused, and under Yama scope 1 its
pid is named as an allowed ptracer before the welcome goes out. The welcome
carries this process's pid and start time, its boot id, the address of a
random probe the initiator must read through cross-memory attach (which
proves both that it may and that the pid is this process), and the region
table's memfd.

Deregistration (``revoke``) is one store in the shared table, then a revoke
message to every connected initiator, sent without waiting: it never blocks
the caller (the event loop) on a peer. Each connection's thread collects the
acks; the region's slot (and the buffer reference that keeps its memory
alive) is released when every initiator acknowledged, or when the ones that
did not are cut off after ``retry_timeout``. A connection that cannot take a
message at once is cut off too.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import secrets
import socket
import threading
import time
import uuid
from typing import Protocol

from ..base import BackendOptions
from ..soft.dial import Expected
from .inuse import InUseView, fence
from .kernel import boot_id, start_time
from .permissions import PtracerPolicy
from .regions import Allocation, CmaRegion, LocalTable
from .table import READ, SLOTS, WRITE, RegionTable
from .wire import HELLO, MAGIC, MSG, VERSION, WELCOME, Kind, ProtocolError, Status, peer_cred, receive, send

__all__ = ["MAX_CONNECTIONS", "Passive", "TargetPort"]

log = logging.getLogger("moriio_async.cma")

MAX_CONNECTIONS = 1024
"""Initiator connections one backend serves at once (each has a thread); more are refused at accept."""


class Passive(Protocol):
    """The passive queue pair a connection attaches to."""

    qp_num: int

    def attach(self, conn: Connection) -> bool:
        """Take the connection; False when the pair is closed or taken."""

    def detach(self) -> None:
        """The connection ended: the pair is unusable from now on."""


class Connection:
    """One initiator's connection, served by its own thread."""

    def __init__(self, port: TargetPort, sock: socket.socket) -> None:
        self.port = port
        self.sock = sock
        self.pid = 0
        self.inuse: InUseView | None = None
        """The initiator's in-use word (``inuse.py``), mapped read-only."""
        self._send_lock = threading.Lock()
        self._pending: dict[int, tuple[CmaRegion, float]] = {}  # rkey -> region, ack deadline
        self._lock = threading.Lock()
        self.closed = False

    def revoke(self, region: CmaRegion) -> None:
        """Tell the initiator, without waiting; a connection that cannot take it now is cut off."""
        with self._lock:
            if self.closed:
                region.acks.discard(self)
                return
            self._pending[region.rkey] = (region, time.monotonic() + self.port.options.retry_timeout)
        try:
            with self._send_lock:
                send(self.sock, MSG.pack(MAGIC, Kind.REVOKE, 0, VERSION, region.rkey, region.rkey, 0), block=False)
        except OSError:
            log.warning("cma: initiator pid %d is not taking revocations; cutting it off", self.pid)
            self.shutdown()

    def establish(self, pid: int) -> None:
        """Count the initiator in revocations, then tell it the pair is up (nothing of ours precedes it).

        Under the send lock, so a revocation racing this is sent after ``established``, which the
        initiator waits for before its ``connect`` returns: once it has, the target holds its in-use
        page and includes it in every deregistration's wait.
        """
        with self._send_lock:
            self.pid = pid
            send(self.sock, MSG.pack(MAGIC, Kind.ESTABLISHED, 0, VERSION, 0, 0, 0))

    def shutdown(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def is_closed(self) -> bool:
        """The connection ended (the initiator left, died, or was cut off)."""
        return self.closed

    def serve(self, passive: Passive) -> None:
        """Acks and fd requests until the initiator leaves (or is cut off)."""
        sock = self.sock
        while True:
            with self._lock:
                due = min((d for _r, d in self._pending.values()), default=None)
            if due is not None and time.monotonic() >= due:
                log.warning("cma: initiator pid %d did not acknowledge a revocation in time; cutting it off", self.pid)
                return
            sock.settimeout(None if due is None else max(0.001, due - time.monotonic()))
            try:
                data, _ = receive(sock)
            except TimeoutError:
                continue
            if len(data) != MSG.size:
                raise ProtocolError(f"a {len(data)}-byte message")
            _m, kind, _status, _v, a, _b, _c = MSG.unpack(data)
            if kind == Kind.ACK:
                with self._lock:
                    entry = self._pending.pop(a, None)
                if entry is not None:
                    self.port.acked(entry[0], self)
            elif kind == Kind.NEED:
                self._send_fd(a)
            else:
                raise ProtocolError(f"message kind {kind} from an initiator")

    def _send_fd(self, alloc_id: int) -> None:
        alloc = self.port.exported_allocation(alloc_id)
        status, size = (Status.NO_SUCH_ALLOCATION, 0) if alloc is None else (Status.OK, alloc.size)
        with self._send_lock:
            reply = MSG.pack(MAGIC, Kind.FD, status, VERSION, alloc_id, 0, size)
            send(self.sock, reply, None if alloc is None else alloc.fd, block=False)

    def finish(self) -> None:
        """The connection ended: what it never acknowledged counts as done (the initiator is gone)."""
        with self._lock:
            self.closed = True
            pending, self._pending = self._pending, {}
        for region, _deadline in pending.values():
            self.port.acked(region, self)
        self.sock.close()
        if self.inuse is not None:
            self.inuse.close()


class TargetPort:
    """The backend's abstract Unix socket and what its initiators see of it."""

    def __init__(
        self, options: BackendOptions, table: RegionTable, local: LocalTable, policy: PtracerPolicy, revoke_wait: float
    ) -> None:
        self.options = options
        self.revoke_wait = revoke_wait
        self.table = table
        self.local = local
        self.policy = policy
        self.name = f"moriio-cma-{os.getpid()}-{secrets.token_hex(8)}"
        self.boot = boot_id()
        self.start = start_time(os.getpid()) or 0
        self._probe = ctypes.create_string_buffer(secrets.token_bytes(16), 16)
        self._lock = threading.Lock()
        self._closed = False
        self.expected: Expected[Passive] = Expected()
        """Passive pairs expecting a dial, by token (each goes at its dial, or when its pair closes)."""
        self._conns: dict[Connection, threading.Thread] = {}
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._sock.bind("\0" + self.name)
        self._sock.listen(128)
        self._thread = threading.Thread(target=self._accept_loop, name=f"moriio-cma-accept-{os.getpid()}", daemon=True)
        self._thread.start()

    @property
    def probe_addr(self) -> int:
        return ctypes.addressof(self._probe)

    def exported_allocation(self, alloc_id: int) -> Allocation | None:
        """The allocation, if a live region exported with remote access lies in it (else peers may not
        map it). Unless one is exported with REMOTE_WRITE it is sealed against writes first, so the
        peer can only read it (None when the kernel cannot seal it)."""
        alloc = self.local.allocations.get(alloc_id)
        if alloc is None:
            return None
        granted = 0
        for r in list(self.local.by_lkey.values()):
            if r.alloc == alloc_id and r.live:
                granted |= self.table.flags(r.rkey)  # what is exported now, not what was registered
        if not granted & (READ | WRITE):
            return None
        if not granted & WRITE and not self.local.seal(alloc):
            return None
        return alloc

    def revoke(self, region: CmaRegion) -> None:
        """Revoke ``region`` in the table and tell every initiator; never waits."""
        self.table.revoke(region.rkey)
        conns = self._wait_windows(region.rkey & (SLOTS - 1))
        region.acks = set(conns)
        if not conns:
            self.table.release(region.rkey)
            return
        for conn in conns:
            conn.revoke(region)

    def quiesce(self) -> None:
        """The backend is closing: every initiator's next check fails as from a vanished peer
        (RETRY_EXC_ERR), and a window one is copying now has ended when this returns (at most
        ``revoke_wait``, after which it is cut off). So no peer moves a byte of this process's
        memory after ``close`` returned, even one whose reader has not yet seen the connection end."""
        self.table.shut()
        self._wait_windows(None)

    def _wait_windows(self, slot: int | None) -> list[Connection]:
        """After a store in the table: wait for the windows that passed their check before it (on
        ``slot``; None: any); the established connections."""
        fence()  # the store is visible before any initiator's in-use word is read
        with self._lock:
            conns = [c for c in self._conns if c.pid]
        deadline = time.monotonic() + self.revoke_wait
        for conn in conns:
            # A window that passed its check just before the store may be moving bytes now: wait
            # for it (about a millisecond), never longer than revoke_wait.
            if conn.inuse is not None and not conn.inuse.wait_clear(slot, deadline, conn.is_closed):
                log.warning("cma: initiator pid %d kept copying past revoke_wait=%gs; cutting it off",
                            conn.pid, self.revoke_wait)  # fmt: skip
                conn.shutdown()
        return conns

    def acked(self, region: CmaRegion, conn: Connection) -> None:
        region.acks.discard(conn)
        if not region.acks:
            self.table.release(region.rkey)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = dict(self._conns)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._thread.join()
        self._sock.close()
        for conn in conns:
            conn.shutdown()
        for thread in conns.values():
            if thread is not threading.current_thread():
                thread.join()

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)  # e.g. EMFILE: do not spin
                continue
            try:
                stranger = peer_cred(sock).uid != os.getuid()
            except OSError:
                stranger = True
            with self._lock:
                full = len(self._conns) >= MAX_CONNECTIONS
            if stranger or full:  # refused before it costs a thread: another user, or too many at once
                if full:
                    log.warning("cma: %d connections already; refusing another", MAX_CONNECTIONS)
                sock.close()
                continue
            conn = Connection(self, sock)
            thread = threading.Thread(target=self._serve, args=(conn,), name="moriio-cma-target", daemon=True)
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._conns[conn] = thread
            thread.start()

    def _serve(self, conn: Connection) -> None:
        passive: Passive | None = None
        try:
            passive = self._welcome(conn)
            if passive is not None:
                conn.serve(passive)
        except (OSError, ProtocolError) as exc:
            if conn.pid:
                log.debug("cma: connection from pid %d ended: %s", conn.pid, exc)
        except BaseException:
            log.exception("cma: target connection failed")
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.finish()
            if passive is not None:
                passive.detach()

    def _welcome(self, conn: Connection) -> Passive | None:
        sock = conn.sock
        sock.settimeout(self.options.connect_timeout)
        data, _ = receive(sock)
        if len(data) != HELLO.size:
            raise ProtocolError("not a hello")
        _m, kind, _s, version, token, _qp, _pid, _r = HELLO.unpack(data)
        cred = peer_cred(sock)

        def refuse(status: Status) -> None:
            send(sock, WELCOME.pack(MAGIC, Kind.WELCOME, status, VERSION, 0, 0, 0, bytes(16), 0, bytes(16), 0, 0))

        if kind != Kind.HELLO or version != VERSION:
            refuse(Status.BAD_VERSION)
            return None
        if cred.uid != os.getuid():
            refuse(Status.WRONG_USER)
            return None
        passive = self.expected.claim(token)
        if passive is None or not passive.attach(conn):
            refuse(Status.UNKNOWN_TOKEN)
            return None
        self.policy.allow(cred.pid)
        boot = uuid.UUID(self.boot).bytes if self.boot else bytes(16)
        welcome = WELCOME.pack(MAGIC, Kind.WELCOME, Status.OK, VERSION, passive.qp_num, os.getpid(), self.start,
                               boot, self.probe_addr, self._probe.raw, len(self.table.records), 0)  # fmt: skip
        send(sock, welcome, self.table.fd)
        data, fd = receive(sock, want_fd=True)
        if len(data) != MSG.size or MSG.unpack(data)[1] != Kind.READY or fd is None:
            if fd is not None:
                os.close(fd)
            passive.detach()
            raise ProtocolError("no ready (with the in-use page) after the welcome")
        try:
            conn.inuse = InUseView(fd)
        except (OSError, ValueError) as exc:
            passive.detach()
            raise ProtocolError(f"a bad in-use page: {exc}") from exc
        finally:
            os.close(fd)
        status = MSG.unpack(data)[2]
        if status:
            passive.detach()
            log.info("cma: initiator pid %d cannot attach to this process (%s)", cred.pid, os.strerror(status))
            return None
        conn.establish(cred.pid)
        return passive
