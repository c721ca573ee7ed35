"""The software TCP backend: a verbs-shaped NIC emulated with threads and sockets.

Modules, one noun each: ``wire`` (the format), ``iov`` (vectored socket I/O
over iovec arrays), ``regions`` (the region table and a NIC's checks, over
whole arrays), ``pairstate`` (a queue pair's locked state: spans, chunks,
counters, in-order completion, the move to ERR), ``sender`` and ``receiver``
(the active side's two threads), ``reactor`` (the one thread serving every
accepted connection, readiness-driven), ``hello`` (a connection in its
hello), ``connection`` and ``responder`` (serving one accepted connection:
its socket's phases, and the NIC's answers), ``pending`` (resumable
non-blocking moves), ``listener`` (the data port and the rendezvous), ``qp`` and
``backend`` (the contract's faces, on ``backends/soft``'s skeleton), ``hooks`` and ``faults`` (fault-injection
seams, and fault plans applied at them).
"""

from __future__ import annotations

from ..base import Backend, BackendOptions
from ..options import TcpOptions
from .backend import TcpBackend
from .faults import PlanHooks
from .hooks import Fault, Hooks
from .qp import TcpQueuePair
from .regions import TcpRegion
from .wire import VendorErr

__all__ = [
    "Fault",
    "Hooks",
    "PlanHooks",
    "TcpBackend",
    "TcpOptions",
    "TcpQueuePair",
    "TcpRegion",
    "VendorErr",
    "open_backend",
]


def open_backend(options: BackendOptions) -> Backend:
    """Open a TCP backend: a data-plane listener on ``options.host``, port 0."""
    return TcpBackend(options)
