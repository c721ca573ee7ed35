"""What cross-memory attach needs from the kernel, what this backend does about it, and how it says so.

``process_vm_readv``/``writev`` on another process are allowed when the
caller may ptrace it (PTRACE_MODE_ATTACH_REALCREDS): the same uid (real,
effective and saved ids of the target all match the caller's), the target
dumpable, and Yama's ``/proc/sys/kernel/yama/ptrace_scope`` agreeing:

* 0: any same-uid process may.
* 1 (the default on Ubuntu and others): only an ancestor, or a process the
  target named with ``prctl(PR_SET_PTRACER, pid)``. The target sets it for
  the initiator of each queue pair it answers, learned from the kernel
  (``SO_PEERCRED``) on the authenticated connection. Yama keeps one such pid
  per process, so a target answering several initiators switches to
  ``PR_SET_PTRACER_ANY`` (any same-uid process may then attach), logged
  once; ``CmaOptions(ptracer="any" | "peer" | "off")`` chooses.
* 2: only with CAP_SYS_PTRACE (in containers, ``--cap-add SYS_PTRACE``).
* 3: never: use shared-memory buffers or another backend.

These checks are the kernel's, and they are coarse: any same-uid process the
kernel lets attach can read and write the whole target. The region checks
this backend makes (rkey, range, access, revocation) protect cooperating
peers from mistakes, not a target from a hostile same-uid process that may
attach. What holds even against one is what the kernel enforces on the
memfds: the region table and the allocations sealed against writes
(``table.py``, ``regions.py``) are written only through their owner's own
mapping.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

from ...errors import BackendUnavailable
from ..options import PTRACER_POLICIES
from .kernel import PR_SET_PTRACER_ANY, set_ptracer, yama_scope

__all__ = ["CmaNotPermitted", "PtracerPolicy", "explain", "has_cap_sys_ptrace"]

log = logging.getLogger("moriio_async.cma")

_CAP_SYS_PTRACE = 19
POLICIES = PTRACER_POLICIES


class CmaNotPermitted(BackendUnavailable):
    """The kernel does not let this process read or write the peer's memory.

    The hook for transport selection: a caller that has another backend to the
    same peer (tcp) catches this one and falls back; the message says why.
    """


def has_cap_sys_ptrace() -> bool:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> _CAP_SYS_PTRACE & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def explain(err: int, pid: int) -> tuple[str, str]:
    """Why ``process_vm_readv`` on ``pid`` failed with ``err``, and what to do (message, hint)."""
    scope = yama_scope()
    yama = "no Yama" if scope is None else f"Yama ptrace_scope={scope}"
    what = f"cross-memory attach to pid {pid} refused ({errno.errorcode.get(err, err)}; uid {os.getuid()}, {yama})"
    if scope == 3:
        hint = "ptrace_scope=3 forbids it until reboot: use shared-memory buffers (allocate_memory) or backend='tcp'"
    elif scope == 2:
        hint = "ptrace_scope=2 needs CAP_SYS_PTRACE (containers: --cap-add SYS_PTRACE), or use backend='tcp'"
    elif scope == 1:
        hint = (
            "the target sets PR_SET_PTRACER for its peers unless CmaOptions(ptracer='off'); "
            "or set kernel.yama.ptrace_scope=0, or grant CAP_SYS_PTRACE, or use backend='tcp'"
        )
    else:
        hint = "both processes must run as the same user and be dumpable (no setuid, PR_SET_DUMPABLE); or backend='tcp'"
    return what, hint


class PtracerPolicy:
    """The target's side: name each initiator as an allowed ptracer, as Yama scope 1 requires."""

    def __init__(self, policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"ptracer must be one of {POLICIES}, not {policy!r}")
        self.policy = policy
        self._lock = threading.Lock()
        self._current: int | None = None
        self._any = False

    def allow(self, pid: int) -> None:
        """Let ``pid`` attach to this process (no-op where Yama does not ask for it)."""
        if self.policy == "off" or yama_scope() != 1:
            return
        with self._lock:
            if self._any or self._current == pid:
                return
            if self.policy == "any" or self._current is not None:
                err = set_ptracer(PR_SET_PTRACER_ANY)
                self._any = not err
                if self.policy == "peer" and not err:
                    log.info(
                        "cma: a second initiator (pid %d) needs PR_SET_PTRACER_ANY: Yama keeps one ptracer per "
                        "process; any same-uid process may now attach to this one (CmaOptions(ptracer='off') "
                        "to forbid)",
                        pid,
                    )
            else:
                err = set_ptracer(pid)
                if not err:
                    self._current = pid
            if err:
                log.warning("cma: prctl(PR_SET_PTRACER) failed: %s", os.strerror(err))
