"""The same-host backend: one-sided READ and WRITE with Linux cross-memory attach, or through shared memory.

An initiator reads and writes the target process's registered memory itself:
``process_vm_readv``/``process_vm_writev`` for ordinary buffers, a plain
``memmove`` through a shared mapping for buffers the target allocated with
``allocate_buffer`` / ``allocate_memory`` (a sealed memfd, passed to the
initiator over the queue pair's Unix socket). Every remote request is
checked against the target's region table (sealed: peers can only read it) before a byte
moves; the target revokes a region on deregistration with one store that
every later check sees, and each initiator acknowledges once its copy in
progress ended. Same RC semantics as the other backends.

Modules, one noun each: ``kernel`` (ctypes: process_vm_*, prctl, mmap;
/proc facts), ``wire`` (the Unix-socket messages), ``table`` (the shared
region table), ``regions`` (local regions and memfd allocations), ``iov``
(iovec windows, transfers and copies), ``pairstate`` (a queue pair's locked
state and in-order completion), ``initiator`` (the dial and the reader),
``worker`` (checks, then bytes), ``target`` (the Unix socket, welcomes,
revocations), ``permissions`` (Yama, PR_SET_PTRACER, the clear error),
``qp`` and ``backend`` (the contract's faces).
"""

from __future__ import annotations

from ..base import Backend, BackendOptions
from ..options import CmaOptions
from .backend import CmaBackend
from .permissions import CmaNotPermitted
from .qp import CmaQueuePair
from .regions import CmaRegion
from .wire import VendorErr

__all__ = ["CmaBackend", "CmaNotPermitted", "CmaOptions", "CmaQueuePair", "CmaRegion", "VendorErr", "open_backend"]


def open_backend(options: BackendOptions) -> Backend:
    """Open a cma backend: its Unix socket (abstract namespace) and its shared region table."""
    return CmaBackend(options)
