"""``moriio-async doctor``'s same-host checks: may a process here read another's memory (cma)?

Cross-memory attach is a ptrace permission. The probe is real: a child
process (not an ancestor, which Yama scope 1 would let through anyway) reads
a random value out of this process with ``process_vm_readv``, once as any
same-uid process would and once after this process named it with
``PR_SET_PTRACER``, as the cma backend's target does for its initiators.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import subprocess
import sys
from typing import Protocol

import numpy as np

from ..backends.cma.kernel import boot_id, process_vm, set_ptracer, yama_scope
from ..backends.cma.permissions import explain, has_cap_sys_ptrace

__all__ = ["Reporter", "check_cma", "probe_main"]

_ERRNO_BASE = 100  # the child exits with 100 + errno (1 is Python's own failure exit)
_SCOPES = {
    0: "any same-uid process may attach",
    1: "only ancestors, or a process the target names with PR_SET_PTRACER (the cma target does)",
    2: "only with CAP_SYS_PTRACE",
    3: "never",
}


class Reporter(Protocol):
    def ok(self, text: str) -> None: ...
    def warn(self, text: str, fix: str | None = None) -> None: ...
    def fail(self, text: str, fix: str | None = None) -> None: ...


def _probe(addr: int, nonce: bytes, *, name_it: bool) -> int:
    """A child reads ``nonce`` at ``addr`` in this process (``name_it``: after PR_SET_PTRACER names it):
    0 when it could, else the errno; -1 when the probe itself broke."""
    code = (
        "import sys; from moriio_async.cli.doctor_cma import probe_main; "
        "sys.exit(probe_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))"
    )
    args = [sys.executable, "-c", code, str(os.getpid()), str(addr), nonce.hex()]
    child = subprocess.Popen(args, stdin=subprocess.PIPE)
    try:
        if name_it:
            set_ptracer(child.pid)
        assert child.stdin is not None
        child.stdin.write(b"go\n")  # the child reads only after this, so the naming comes first
        child.stdin.close()
        status = child.wait(30)
    except (OSError, subprocess.TimeoutExpired):
        return -1
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if name_it:
            set_ptracer(0)  # no exception left behind
    return status - _ERRNO_BASE if _ERRNO_BASE <= status < 255 else 0 if status == 0 else -1


def probe_main(pid: int, addr: int, nonce_hex: str) -> int:
    """The child's side of the probe: the errno of reading the parent (0: it read the right bytes)."""
    sys.stdin.readline()
    got = np.zeros(16, np.uint8)
    _n, err = process_vm(pid, False, np.array([[got.ctypes.data, 16]], np.uint64), np.array([[addr, 16]], np.uint64))
    if err:
        return _ERRNO_BASE + min(err, 254 - _ERRNO_BASE)
    return 0 if got.tobytes().hex() == nonce_hex else 255


def check_cma(report: Reporter) -> bool:
    """Print what cross-memory attach needs here and whether it works; True when it does."""
    scope = yama_scope()
    uid, cap = os.getuid(), has_cap_sys_ptrace()
    if scope is None:
        report.ok("cma: no Yama in this kernel: any same-uid, dumpable process may attach")
    elif scope == 3:
        report.fail(f"cma: Yama ptrace_scope=3: {_SCOPES[3]}", "use backend='tcp' (scope 3 holds until reboot)")
    elif scope == 2 and not cap:
        report.fail(f"cma: Yama ptrace_scope=2: {_SCOPES[2]}, which this process lacks",
                    "grant CAP_SYS_PTRACE (containers: --cap-add SYS_PTRACE) or use backend='tcp'")  # fmt: skip
    else:
        report.ok(f"cma: Yama ptrace_scope={scope}: {_SCOPES[scope]}")
    report.ok(f"cma: uid {uid}, CAP_SYS_PTRACE {'yes' if cap else 'no'}, boot id {boot_id() or '?'}")
    nonce = secrets.token_bytes(16)
    buf = ctypes.create_string_buffer(nonce, 16)
    plain = _probe(ctypes.addressof(buf), nonce, name_it=False)
    if plain == 0:
        report.ok("cma: a same-uid process that is not an ancestor read this one (process_vm_readv)")
        return True
    named = _probe(ctypes.addressof(buf), nonce, name_it=True) if plain > 0 else -1
    if named == 0:
        report.ok(
            "cma: another process may attach once named with PR_SET_PTRACER (the cma target names each of its "
            "initiators), not before"
        )
        return True
    if named < 0 and plain < 0:
        report.fail("cma: the probe process failed", "run `python -c 'import moriio_async.backends.cma'` to see why")
        return False
    what, hint = explain(named if named > 0 else plain, os.getpid())
    report.fail(f"cma: {what}", hint)
    return False
