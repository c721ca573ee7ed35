"""The Linux calls the cma backend needs, through ctypes: cross-memory attach, prctl, mmap; /proc facts.

ctypes foreign calls release the GIL for their duration, so a NIC thread in
``process_vm_readv`` or ``memmove`` lets the event loop run. Everything here
is stateless and thread-safe.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from pathlib import Path
from typing import Final

import numpy as np
import numpy.typing as npt

__all__ = [
    "IOV_MAX",
    "PR_SET_PTRACER",
    "PR_SET_PTRACER_ANY",
    "boot_id",
    "map_shared",
    "memmove",
    "process_vm",
    "set_ptracer",
    "start_time",
    "unmap",
    "yama_scope",
]

IOV_MAX: Final = 1024
"""iovec entries per side of one process_vm_readv/writev call (UIO_MAXIOV)."""
PR_SET_PTRACER: Final = 0x59616D61  # "Yama"
PR_SET_PTRACER_ANY: Final = -1  # (unsigned long)-1

_libc = ctypes.CDLL(None, use_errno=True)
_readv = _libc.process_vm_readv
_writev = _libc.process_vm_writev
for _fn in (_readv, _writev):
    _fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    _fn.restype = ctypes.c_ssize_t
prctl = _libc.prctl  # public: the one libc call tests replace (no Yama here to set a ptracer for real)
prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
prctl.restype = ctypes.c_int
_mmap = _libc.mmap
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_mmap.restype = ctypes.c_void_p
_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_madvise.restype = ctypes.c_int
_MADV_HUGEPAGE: Final = getattr(mmap, "MADV_HUGEPAGE", 14)
_munmap = _libc.munmap
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_munmap.restype = ctypes.c_int
_MAP_POPULATE: Final = getattr(mmap, "MAP_POPULATE", 0x8000)
_MAP_FAILED: Final = ctypes.c_void_p(-1).value

memmove = ctypes.memmove
"""``memmove(dst, src, n)`` on raw addresses, with the GIL released."""

U64 = npt.NDArray[np.uint64]


def process_vm(pid: int, write: bool, local: U64, remote: U64) -> tuple[int, int]:
    """One ``process_vm_writev`` (``write``) or ``process_vm_readv`` between iovec arrays.

    ``local`` and ``remote`` are C-contiguous ``(n, 2)`` uint64 arrays of (address, length),
    at most ``IOV_MAX`` rows each. Returns (bytes moved, errno): the kernel moves whole
    remote iovec elements, so a short count means the element after it failed (call again
    from there to learn why), and -1 comes back as (0, errno).
    """
    call = _writev if write else _readv
    got = call(pid, local.ctypes.data, len(local), remote.ctypes.data, len(remote), 0)
    if got < 0:
        return 0, ctypes.get_errno() or errno.EIO
    return int(got), 0


def set_ptracer(pid: int) -> int:
    """``prctl(PR_SET_PTRACER, pid)`` (``PR_SET_PTRACER_ANY`` for any process): 0 or the errno.

    Yama keeps one such exception per process: a later call replaces the earlier one.
    Without Yama the call fails with EINVAL, which means no exception is needed.
    """
    arg = ctypes.c_ulong(pid).value  # -1 becomes (unsigned long)-1, as the kernel expects
    if prctl(PR_SET_PTRACER, arg, 0, 0, 0) < 0:
        return ctypes.get_errno() or errno.EIO
    return 0


def map_shared(fd: int, length: int, writable: bool) -> int:
    """``mmap(MAP_SHARED)`` of ``length`` bytes of ``fd``; the address. Raises OSError."""
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    # MAP_POPULATE: fault every page in now (once, off the copy path), not one fault per 4 KiB under a copy.
    addr = _mmap(None, length, prot, mmap.MAP_SHARED | _MAP_POPULATE, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {length} bytes: {os.strerror(err)}")
    # Huge pages where the kernel allows them for shmem (shmem_enabled advise/within_size): far fewer
    # TLB misses when copying blocks. Refused (EINVAL) or ignored elsewhere, which is fine.
    _madvise(addr, length, _MADV_HUGEPAGE)
    return int(addr)


def unmap(addr: int, length: int) -> None:
    if _munmap(addr, length) < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"munmap: {os.strerror(err)}")


def start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (clock ticks after boot), or None when there is no such process.

    A pid and its start time name one process for the life of the machine: a pid reused
    after the process exits comes with a later start time.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # comm (field 2) may contain spaces and parentheses: the fields after it start after the last ')'.
    rest = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(rest[19])
    except (IndexError, ValueError):
        return None


def boot_id() -> str:
    """This boot's id (random per boot): two processes with the same one share a kernel."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def yama_scope() -> int | None:
    """/proc/sys/kernel/yama/ptrace_scope (0-3), or None when Yama is not in this kernel."""
    try:
        return int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip())
    except (OSError, ValueError):
        return None
