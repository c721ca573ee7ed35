"""Processes for the cma backend's own tests: a target that can be made unattachable, and an initiator.

``python -m tests.backends.cma_peer target SIZE [--shared] [--undumpable]`` opens a cma
backend, registers SIZE bytes (``--shared``: a memfd allocation), reads the initiator's
endpoint (one JSON line on stdin), answers one JSON line (its endpoint and region), and
serves until stdin closes. ``--undumpable`` first clears
PR_SET_DUMPABLE, so only a process with CAP_SYS_PTRACE may attach to it.

``python -m tests.backends.cma_peer doctor`` runs doctor's cma checks in a process no other
may attach to and prints their verdict and lines.

``python -m tests.backends.cma_peer initiator`` drops CAP_SYS_PTRACE, prints its pair's
endpoint, reads the target's from stdin and prints one JSON line: what connecting to it
gave (``ok``, or the error's type and message).

``python -m tests.backends.cma_peer hostile`` is a hostile peer of the same user: it connects
as an initiator, keeps the region table's memfd it is handed, asks for an allocation's memfd
(``{"alloc": id}`` on stdin) and tries every way to write it, then rewrites a table slot as told
(``{"slot": n, "record": hex, "table_fd": the target's fd number}``) every way it can. Each
answer maps a route to ``"ok"`` (it wrote) or the errno's name.
"""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import sys
from collections.abc import Callable

import numpy as np

from moriio_async.backends import open_backend
from moriio_async.backends.base import BackendOptions
from moriio_async.backends.cma import CmaBackend, CmaQueuePair
from moriio_async.backends.cma import initiator as cma_initiator
from moriio_async.backends.cma.kernel import map_shared, unmap
from moriio_async.backends.cma.table import TableView
from moriio_async.status import Access

PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
CAP_SYS_PTRACE = 19


def say(obj: object) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def target(size: int, shared: bool, undumpable: bool) -> None:
    if undumpable:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE)")
    backend = open_backend("cma", BackendOptions())
    assert isinstance(backend, CmaBackend)
    qp = backend.create_qp(backend.create_cq(64))
    if shared:
        mr = backend.allocate_memory(size)
    else:
        buf = np.zeros(size, np.uint8)
        mr = backend.register_memory(memoryview(buf), Access.all())
    backend.export_memory(mr)  # peers reach only exported regions
    qp.connect(json.loads(sys.stdin.readline()))
    say({"endpoint": dict(qp.endpoint()), "addr": mr.addr, "rkey": mr.rkey, "length": mr.length})
    sys.stdin.readline()
    qp.close()
    backend.close()


def drop_cap_sys_ptrace() -> None:
    """Clear CAP_SYS_PTRACE from this process's bounding, effective and permitted sets, so neither
    it nor a child it starts (even as root) has it."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_CAPBSET_DROP, CAP_SYS_PTRACE, 0, 0, 0) != 0 and ctypes.get_errno() != errno.EPERM:
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # two {effective, permitted, inheritable}
    if libc.capget(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    data[0] &= ~(1 << CAP_SYS_PTRACE)
    data[1] &= ~(1 << CAP_SYS_PTRACE)
    if libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def initiator() -> None:
    drop_cap_sys_ptrace()  # so that an undumpable target refuses even a root initiator
    backend = open_backend("cma", BackendOptions(connect_timeout=10.0))
    qp = backend.create_qp(backend.create_cq(64))
    say({"endpoint": dict(qp.endpoint())})
    remote = json.loads(sys.stdin.readline())
    try:
        qp.connect(remote)
    except Exception as exc:
        say({"ok": False, "type": type(exc).__name__, "message": str(exc)})
    else:
        say({"ok": True})
    qp.close()
    backend.close()


def attempt(fn: Callable[[], None]) -> str:
    try:
        fn()
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return "ok"


def write_every_way(fd: int, data: bytes, offset: int, proc_path: str | None) -> dict[str, str]:
    """Try to put ``data`` at ``offset`` of the memfd ``fd`` by each route a process holding it has."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    size = os.fstat(fd).st_size
    page = offset - offset % mmap.PAGESIZE

    def through_mapping(f: int) -> None:
        with mmap.mmap(f, size) as m:  # MAP_SHARED, PROT_READ | PROT_WRITE
            m[offset : offset + len(data)] = data

    def mprotect() -> None:
        addr = map_shared(fd, size, writable=False)
        try:
            if libc.mprotect(addr + page, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE) != 0:
                raise OSError(ctypes.get_errno(), "mprotect")
            ctypes.memmove(addr + offset, data, len(data))
        finally:
            unmap(addr, size)

    def through_pwrite(f: int) -> None:
        os.pwrite(f, data, offset)

    def reopened() -> None:
        f = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        try:
            through_pwrite(f)
        finally:
            os.close(f)

    def punch() -> None:
        if libc.fallocate(fd, 0x01 | 0x02, page, mmap.PAGESIZE) != 0:  # KEEP_SIZE | PUNCH_HOLE: zeroes it
            raise OSError(ctypes.get_errno(), "fallocate")

    def by_path() -> None:
        assert proc_path is not None
        f = os.open(proc_path, os.O_RDWR)
        try:
            through_mapping(f)
        finally:
            os.close(f)

    routes: dict[str, Callable[[], None]] = {
        "mmap": lambda: through_mapping(fd),
        "pwrite": lambda: through_pwrite(fd),
        "mprotect": mprotect,
        "reopen": reopened,
        "punch_hole": punch,
    }
    if proc_path is not None:
        routes["proc_path"] = by_path
    return {name: attempt(fn) for name, fn in routes.items()}


def hostile() -> None:
    tables: list[int] = []

    class Keeping(TableView):
        def __init__(self, fd: int) -> None:
            tables.append(os.dup(fd))  # what the target handed over, kept
            super().__init__(fd)

    setattr(cma_initiator, "TableView", Keeping)  # noqa: B010 (a hostile peer runs whatever code it likes)
    backend = open_backend("cma", BackendOptions(connect_timeout=10.0))
    qp = backend.create_qp(backend.create_cq(64))
    assert isinstance(qp, CmaQueuePair)
    say({"endpoint": dict(qp.endpoint())})
    qp.connect(json.loads(sys.stdin.readline()))
    assert qp.link is not None and tables
    ask = json.loads(sys.stdin.readline())
    got = qp.link.fetch(int(ask["alloc"]), 10.0)  # the NEED message: the memfd as any initiator gets it
    if got is None:
        say({"handed": False})
    else:
        say({"handed": True, "routes": write_every_way(got[0], b"\xee" * 64, 0, None)})
        os.close(got[0])
    order = json.loads(sys.stdin.readline())
    if order:
        record = bytes.fromhex(order["record"])
        path = f"/proc/{order['pid']}/fd/{order['table_fd']}"  # a same-user process may open it by path
        say({"routes": write_every_way(tables[0], record, int(order["slot"]) * len(record), path)})
        sys.stdin.readline()
    qp.close()
    backend.close()


def doctor() -> None:
    """``check_cma`` in a process no other may attach to (undumpable, without CAP_SYS_PTRACE)."""
    from moriio_async.cli.doctor_cma import check_cma

    drop_cap_sys_ptrace()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE)")
    lines: list[str] = []

    class Lines:
        def ok(self, text: str) -> None:
            lines.append(f"ok {text}")

        def warn(self, text: str, fix: str | None = None) -> None:
            lines.append(f"warn {text} fix: {fix}")

        def fail(self, text: str, fix: str | None = None) -> None:
            lines.append(f"FAIL {text} fix: {fix}")

    works = check_cma(Lines())
    say({"works": works, "lines": lines})


if __name__ == "__main__":
    {"target": lambda: target(int(sys.argv[2]), "--shared" in sys.argv, "--undumpable" in sys.argv),
     "initiator": initiator, "doctor": doctor, "hostile": hostile}[sys.argv[1]]()  # fmt: skip
