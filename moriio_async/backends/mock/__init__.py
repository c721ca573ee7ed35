"""An in-process backend that keeps the whole contract, for tests of the layers above.

Two engines in one process connect through it as through a NIC; a posted
batch executes as array checks and copies between their buffers, on the
posting thread. It is public so users can test their own code against
moriio_async without sockets or RDMA. It is not evidence that a real backend
works: the TCP and verbs backends run the conformance suite for that.

Settings: ``MockOptions`` (``IOEngineConfig(mock=MockOptions(...))``):

``hold``
    Each queue pair keeps its posted requests until the test calls
    ``MockQueuePair.step(n)``, which makes completion timing a plain function
    of the test's own calls (no sleeps, no threads).
``silent_cq``
    Completion queues raise no channel events, as a NIC that lost a wakeup
    would: only an explicit drain sees their completions.
``fabric``
    A ``MockFabric`` shared by the backends that should reach each other
    (default: the process's default fabric).

Faults: ``MockQueuePair.fail_next(status)`` ends the next executed request
with that status; ``vanish()`` behaves like a dead peer (RETRY_EXC_ERR, then
flushes); closing the peer's queue pair or backend does too, for whatever
runs next.
"""

from __future__ import annotations

from ..base import Backend, BackendOptions
from ..options import MockOptions
from .backend import MockBackend
from .fabric import MockFabric
from .qp import MockQueuePair

__all__ = ["MockBackend", "MockFabric", "MockOptions", "MockQueuePair", "open_backend"]


def open_backend(options: BackendOptions) -> Backend:
    return MockBackend(options)
