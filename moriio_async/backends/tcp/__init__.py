"""The software TCP backend: a verbs-shaped NIC emulated with threads and sockets.

Modules, one noun each: ``wire`` (headers and zero-copy socket loops),
``regions`` (the region table and a NIC's checks), ``cq`` (completion queue
with an eventfd channel), ``qp`` (queue-pair state, slots, in-order
completion), ``sender`` and ``receiver`` (the active side's two threads),
``responder`` (the passive side's thread), ``hooks`` (fault-injection seams),
``backend`` (TcpBackend and its listener).
"""

from __future__ import annotations

from ..base import Backend, BackendOptions
from ..softcq import SoftCompletionQueue as TcpCompletionQueue
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
    "TcpCompletionQueue",
    "TcpQueuePair",
    "TcpRegion",
    "VendorErr",
    "open_backend",
]


def open_backend(options: BackendOptions) -> Backend:
    """Open a TCP backend: a data-plane listener on ``options.host``, port 0."""
    return TcpBackend(options)
