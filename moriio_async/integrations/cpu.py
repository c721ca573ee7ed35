"""What a CPU-only vLLM process needs before its first decode step (x86-64 Linux).

vLLM-CPU's AMX attention kernel uses the AMX tile registers. Linux hands those
out per process only after ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``
(kernel 5.16+); without it the first AMX instruction is ``SIGILL``. A prefill
step happens to ask through oneDNN's own code path first; a worker whose first
step is decode-only (every decode server) never does, and dies with
``Illegal instruction`` in ``cpu_attention_with_kv_cache``. Asking is harmless
where AMX is absent (the call fails with EINVAL and nothing changes).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import sys

__all__ = ["ARCH_REQ_XCOMP_PERM", "XFEATURE_XTILEDATA", "request_amx_permission"]

log = logging.getLogger("moriio_async")

SYS_ARCH_PRCTL = 158  # x86-64 syscall number
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def request_amx_permission() -> bool:
    """Ask Linux for AMX tile data permission for this process; True when granted (or already held)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    # EINVAL: no AMX on this CPU (or a kernel before 5.16); nothing to do, nothing broken.
    level = logging.DEBUG if err == errno.EINVAL else logging.WARNING
    log.log(level, "arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) failed: %s", os.strerror(err))
    return False
