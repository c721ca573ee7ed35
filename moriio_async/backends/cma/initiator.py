"""The initiator's side of a queue pair's connection: the dial, the target's identity, its table and mappings.

``dial`` opens the connection and checks, before any request can run, that
the other end is who the endpoint says: the kernel's view of it
(``SO_PEERCRED``: same uid, the pid it claims), its start time in
``/proc/<pid>/stat`` (a reused pid has a later one), the same boot id, and a
random probe read through ``process_vm_readv`` (which also proves the
kernel lets this process attach; if it does not, the connect fails here with
``CmaNotPermitted`` and one line saying why). A pidfd on the target then
answers "has it exited?" with one non-blocking poll before every window.

The reader thread applies revocations (under the pair's ``copy_lock``, so
the copy in progress ends first, then any shared mapping no live region
needs is unmapped) and acknowledges them, delivers memfds the worker asked
for, and turns the end of the connection into RETRY_EXC_ERR.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import select
import socket
import threading
import uuid

import numpy as np

from ...errors import PeerError
from ...status import WcStatus
from ..base import BackendOptions, QpState, specific_options
from ..options import CmaOptions
from ..soft.dial import closed_on_failure
from .inuse import InUse
from .kernel import boot_id, map_shared, process_vm, start_time, unmap
from .pairstate import PairState
from .permissions import CmaNotPermitted, explain
from .table import FUTURE_WRITE, LIVE, TableView
from .wire import HELLO, MAGIC, MSG, VERSION, WELCOME, Kind, ProtocolError, Status, VendorErr, peer_cred, receive, send

__all__ = ["MAX_MAPPINGS", "TargetLink", "dial"]

log = logging.getLogger("moriio_async.cma")

MAX_MAPPINGS = 4096
"""Shared allocations of one target an initiator queue pair maps at once."""


class TargetLink:
    """A connected target: its pid (in this namespace), table view, mappings and connection."""

    def __init__(self, sock: socket.socket, pid: int, view: TableView, inuse: InUse) -> None:
        self.sock = sock
        self.pid = pid
        self.view = view
        self.inuse = inuse
        """The word the target reads before a deregistration returns (``inuse.py``)."""
        self.pidfd = os.pidfd_open(pid)
        self._polls = threading.local()  # a poll object cannot be used by two threads at once
        self.maps: dict[int, tuple[int, int]] = {}  # allocation id -> (address, size), under copy_lock
        self.read_only: set[int] = set()
        """Mapped allocations sealed against writes (mapped PROT_READ): writes to them go by cross-memory
        attach, never through the mapping (a store there would be SIGSEGV). Under copy_lock."""
        self._send_lock = threading.Lock()
        self._need = threading.Condition()
        self._fds: dict[int, tuple[int, int] | None] = {}  # allocation id -> (fd, size), or None: refused
        self._asked = 0  # the allocation a fetch waits for (one at a time: only the worker fetches)
        self.gone = False
        """The connection ended (set by the reader): the target closed its pair, or exited."""
        self.gone_vendor = VendorErr.PEER_CLOSED

    def exited(self) -> bool:
        """The target process has exited (one non-blocking poll of its pidfd)."""
        poll: select.poll | None = getattr(self._polls, "poll", None)
        if poll is None:
            poll = self._polls.poll = select.poll()
            poll.register(self.pidfd, select.POLLIN)
        return bool(poll.poll(0))

    def fetch(self, alloc_id: int, timeout: float) -> tuple[int, int] | None:
        """Ask the target for an allocation's memfd: (fd, size), or None (refused, gone, or no answer)."""
        with self._need:
            self._fds.pop(alloc_id, None)
            self._asked = alloc_id
        try:
            with self._send_lock:
                send(self.sock, MSG.pack(MAGIC, Kind.NEED, 0, VERSION, alloc_id, 0, 0), block=False)
        except OSError:
            return None
        with self._need:
            self._need.wait_for(lambda: alloc_id in self._fds or self.gone, timeout)
            self._asked = 0
            return self._fds.pop(alloc_id, None)

    def map(self, alloc_id: int, st: PairState, timeout: float) -> bool:
        """Map an allocation (not under ``copy_lock``: this waits on the target). False if it cannot be."""
        if alloc_id in self.maps:
            return True
        if len(self.maps) >= MAX_MAPPINGS:
            return False
        got = self.fetch(alloc_id, timeout)
        if got is None:
            return False
        fd, size = got
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            if not seals & fcntl.F_SEAL_SHRINK or os.fstat(fd).st_size < size or size <= 0:
                return False  # a file that may shrink could fault (SIGBUS) under a copy
            # Sealed against writes (or a read-only descriptor): the kernel maps it for reading only.
            writable = not seals & FUTURE_WRITE and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR
            addr = map_shared(fd, size, writable=writable)
        except OSError:
            return False
        finally:
            os.close(fd)
        with st.copy_lock:
            # A revocation applied while the fd was on its way may have left no live region in it:
            # then the mapping is not kept (the reader's scan could not see it yet).
            if alloc_id in self.maps or self.gone or alloc_id not in self._needed():
                unmap(addr, size)
            else:
                self.maps[alloc_id] = (addr, size)
                if not writable:
                    self.read_only.add(alloc_id)
        return True

    def _needed(self) -> set[int]:
        """The allocations some live region of the target's table lies in."""
        records = self.view.records
        live = (records["flags"] & np.uint32(LIVE)) != 0
        return set(np.unique(records["alloc"][live]).tolist())

    def read_loop(self, st: PairState) -> None:
        """Revocations, memfds and the end of the connection, until the pair leaves RTS."""
        while True:
            try:
                data, fd = receive(self.sock, want_fd=True)
            except (OSError, ProtocolError):
                self._gone(st, VendorErr.PEER_EXITED if self.exited() else VendorErr.PEER_CLOSED)
                return
            if len(data) != MSG.size:
                if fd is not None:
                    os.close(fd)
                self._gone(st, VendorErr.BAD_MESSAGE)
                return
            _m, kind, status, _v, a, _b, c = MSG.unpack(data)
            if kind == Kind.REVOKE:
                if fd is not None:
                    os.close(fd)
                self._revoked(st, a)
            elif kind == Kind.FD:
                with self._need:
                    # Only the answer to the one request in flight is kept: a target cannot make
                    # this process hold descriptors it did not ask for.
                    keep = a == self._asked and a not in self._fds
                    if keep:
                        self._fds[a] = (fd, int(c)) if fd is not None and not status else None
                        self._need.notify_all()
                if fd is not None and (status or not keep):
                    os.close(fd)
            else:
                if fd is not None:
                    os.close(fd)
                self._gone(st, VendorErr.BAD_MESSAGE)
                return

    def _revoked(self, st: PairState, rkey: int) -> None:
        with st.copy_lock:  # the copy in progress ends first; every later check sees the revocation
            if self.maps:
                needed = self._needed()
                for alloc_id in [k for k in self.maps if k not in needed]:
                    addr, size = self.maps.pop(alloc_id)
                    self.read_only.discard(alloc_id)
                    unmap(addr, size)
        try:
            with self._send_lock:
                send(self.sock, MSG.pack(MAGIC, Kind.ACK, 0, VERSION, rkey, 0, 0), block=False)
        except OSError:
            pass  # the connection is ending: the reader sees it next

    def _gone(self, st: PairState, vendor: VendorErr) -> None:
        with self._need:
            self.gone = True
            self._need.notify_all()
        self.gone_vendor = vendor
        with st.lock:
            # As on a wire: with nothing outstanding the pair stays RTS, and the next request
            # fails RETRY_EXC_ERR (the worker checks ``gone`` before every window).
            if st.state == QpState.RTS and st.pending:
                st.fail_locked(WcStatus.RETRY_EXC_ERR, vendor)

    def shutdown(self) -> None:
        """End the connection (wakes the reader; the target sees the initiator leave)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Unmap everything and close (the pair's threads have stopped)."""
        for addr, size in self.maps.values():
            unmap(addr, size)
        self.maps.clear()
        self.read_only.clear()
        with self._need:
            for got in self._fds.values():
                if got is not None:
                    os.close(got[0])
            self._fds.clear()
        self.view.close()
        self.inuse.close()
        os.close(self.pidfd)
        self.sock.close()


_refused: set[tuple[int, int]] = set()
_refused_lock = threading.Lock()


def _first_refusal(pid: int, started: int) -> bool:
    """True the first time the kernel refuses this process (pid and start time); bounded memory."""
    with _refused_lock:
        if (pid, started) in _refused:
            return False
        if len(_refused) >= 1024:
            _refused.clear()
        _refused.add((pid, started))
        return True


def dial(endpoint: dict[str, object], qp_num: int, token: bytes, options: BackendOptions) -> TargetLink:
    """Connect to the target's backend and check who it is. Raises PeerError, CmaNotPermitted."""
    name, boot = str(endpoint.get("socket", "")), str(endpoint.get("boot_id", ""))
    if boot != boot_id():
        raise PeerError(
            f"qp {qp_num}: the cma peer runs under another kernel (boot id {boot or '?'}, here {boot_id()})",
            hint="cma reaches processes on this host only; use backend='tcp' or 'verbs' across hosts",
        )
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    sock.settimeout(options.connect_timeout)
    with closed_on_failure(sock, f"qp {qp_num}: cma handshake failed", ProtocolError):
        return _handshake(sock, name, boot, qp_num, token, options)


def _handshake(
    sock: socket.socket, name: str, boot: str, qp_num: int, token: bytes, options: BackendOptions
) -> TargetLink:
    fd: int | None = None
    try:
        try:
            sock.connect("\0" + name)
        except OSError as exc:
            raise PeerError(
                f"qp {qp_num}: no cma backend answers at @{name}: {exc}",
                hint="the peer closed, or runs in another network namespace (abstract Unix sockets are per netns)",
            ) from exc
        send(sock, HELLO.pack(MAGIC, Kind.HELLO, 0, VERSION, token, qp_num, os.getpid(), 0))
        data, fd = receive(sock, want_fd=True)
        if len(data) != WELCOME.size:
            raise ProtocolError("not a welcome")
        _m, kind, status, _version, _peer_qp, pid, started, boot_raw, probe, nonce, _slots, _r = WELCOME.unpack(data)
        if kind != Kind.WELCOME or status != Status.OK or fd is None:
            why = next((m.name for m in Status if m == status), f"status {status}")
            raise PeerError(
                f"qp {qp_num}: the cma target refused the connection ({why})",
                hint="the passive pair was closed, the peer runs as another user, or versions differ",
            )
        cred = peer_cred(sock)
        if cred.pid != pid:
            raise PeerError(
                f"qp {qp_num}: the cma target says pid {pid}, the kernel says {cred.pid}",
                hint="the peer runs in another pid namespace: cma needs both in one (or use tcp)",
            )
        if cred.uid != os.getuid():
            raise CmaNotPermitted(f"qp {qp_num}: the cma target runs as uid {cred.uid}, this process as {os.getuid()}")
        if start_time(pid) != started or uuid.UUID(bytes=boot_raw) != uuid.UUID(boot):
            raise PeerError(f"qp {qp_num}: pid {pid} is not the process that answered (start time differs)")
        try:
            view = TableView(fd)
        except ValueError as exc:  # e.g. a table peers could write (an older target: version 1)
            raise ProtocolError(str(exc)) from exc
        os.close(fd)
        fd = None
        got = np.zeros(16, np.uint8)
        local, remote = np.array([[got.ctypes.data, 16]], np.uint64), np.array([[probe, 16]], np.uint64)
        _n, err = process_vm(pid, False, local, remote)
        inuse = InUse()
        send(sock, MSG.pack(MAGIC, Kind.READY, err & 0xFF, VERSION, 0, 0, 0), inuse.fd)
        if err:
            inuse.close()
            view.close()
            what, hint = explain(err, pid)
            if _first_refusal(pid, started):  # one line per target process, however many pairs try
                # With a transport to fall back on, the engine says it (once, with this reason).
                quiet = specific_options(options, CmaOptions).quiet_refusal
                log.log(logging.INFO if quiet else logging.WARNING, "cma: %s; fix: %s", what, hint)
            raise CmaNotPermitted(f"qp {qp_num}: {what}", hint=hint)
        if got.tobytes() != nonce:
            inuse.close()
            view.close()
            raise PeerError(f"qp {qp_num}: pid {pid}'s probe does not match: not the process that answered")
        # Wait until the target has taken the in-use page: before that, a deregistration there would
        # not wait for a copy of ours, and the pair is not up on both sides (its fds not yet there).
        data, _ = receive(sock)
        if len(data) != MSG.size or MSG.unpack(data)[1] != Kind.ESTABLISHED:
            inuse.close()
            view.close()
            raise ProtocolError("no 'established' after ready")
        sock.settimeout(None)
        return TargetLink(sock, pid, view, inuse)
    finally:
        if fd is not None:
            os.close(fd)
