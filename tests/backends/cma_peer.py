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
"""

from __future__ import annotations

import ctypes
import errno
import json
import sys

import numpy as np

from moriio_async.backends import open_backend
from moriio_async.backends.base import BackendOptions
from moriio_async.backends.cma import CmaBackend
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
     "initiator": initiator, "doctor": doctor}[sys.argv[1]]()  # fmt: skip
