"""The verbs backend: real RDMA through pyverbs (rdma-core >= 57), one device per backend.

Importing this package costs nothing: pyverbs is imported (by ``_pyverbs``
only) when ``open_backend`` or ``probe`` is first called, and a missing
pyverbs or RDMA device becomes ``BackendUnavailable`` saying what to do.

Design, in one place:

* Threads: one daemon thread per backend, for device async events
  (``events.py``); everything else runs on the caller's (event-loop) thread.
* Fds: each completion queue's ``fileno()`` is an epoll fd holding its
  completion channel and an eventfd for completions the backend makes up
  (``cq.py``); -1 when pyverbs has no ``CompChannel.fd``.
* GID: the RoCE v2 IPv4-mapped entry by default (``gid.py``), logged with why.
* Flushes: ``to_error`` moves the pair to ERR and the device flushes every
  outstanding request, unsignaled ones included; a ledger per pair
  (``ledger.py``) keeps slots, opcodes and lengths, and makes up the
  completions the hardware cannot give (dead device, refused posts).
"""

from __future__ import annotations

from ..base import Backend, BackendOptions
from .facts import ProbeReport

__all__ = ["open_backend", "probe"]


def open_backend(options: BackendOptions) -> Backend:
    """Open the RDMA device ``options`` names (or the first with an ACTIVE port)."""
    from .backend import VerbsBackend

    return VerbsBackend(options)


def probe(port: int | None = None) -> ProbeReport:
    """What this node's RDMA stack looks like, for ``doctor``; never raises."""
    from .probe import run_probe

    return run_probe(port)
