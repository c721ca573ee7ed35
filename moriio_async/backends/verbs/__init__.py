"""The verbs backend: real RDMA through pyverbs (rdma-core >= 57), one device per backend.

Importing this package costs nothing: pyverbs is imported (by ``_pyverbs``
only) when ``open_backend`` or ``probe`` is first called, and a missing
pyverbs or RDMA device becomes ``BackendUnavailable`` saying what to do.

Design, in one place:

* Threads: one daemon thread per backend, for device async events
  (``events.py``); everything else runs on the caller's (event-loop) thread.
  pyverbs' ``get_async_event`` blocks holding the GIL, so the thread waits
  on the device's async fd (found at open, made non-blocking) in
  ``select.poll`` and only then takes the event.
* Fds: each completion queue's ``fileno()`` is a non-blocking epoll fd holding
  its own completion channel and an eventfd for completions the backend
  makes up (``cq.py``); -1 when pyverbs has no ``CompChannel.fd``.
* GID: the RoCE v2 IPv4-mapped entry by default, the one of ``host`` when
  listed (``gid.py``); the choice and its reason are logged and described.
* Flushes: ``to_error`` moves the pair to ERR and the device flushes every
  outstanding request with its own WR_FLUSH_ERR, unsignaled ones included
  (seen on rxe: 16 of 16; posts on a pair in ERR flush too). A ledger per
  pair (``ledger.py``) keeps slots, opcodes and lengths, and makes up the
  completions the device cannot give: requests refused before the wire
  (bad local SGE: LOC_PROT_ERR, nothing moved), pairs on a dead device or
  CQ (FATAL_ERR, then flushes); a signaled fence lets them out in order.
* Events: PORT_ERR moves every pair to ERR at once (a batch fails in
  milliseconds, not after the retry timers); DEVICE_FATAL and CQ_ERR fail
  every pair from the ledgers; QP events are matched by querying states,
  since pyverbs 59 does not say which pair; a pair in ERR that the device
  has not flushed within ``VerbsOptions.flush_grace`` (2 s) is flushed
  from its ledger.
* Posting: a whole chunk per call, as one extended-QP section (``wr_start``,
  per request ``wr_id``/``wr_flags``/``wr_rdma_*`` and a reused ``SGE``,
  ``wr_complete``: one doorbell); the ledger keeps spans over the posted
  batch, and local entries are checked vectorised per chunk (``checks.py``).
  Providers without extended-QP send ops (or ``VerbsOptions.extended_qp``
  False) post one ``ibv_post_send`` per request.
* rxe quirks handled: ``wr_set_sge_list`` miscounts a request whose scatter
  entries differ in length (such a request is posted alone with
  ``ibv_post_send``); ``retry_cnt`` 7 means "forever" there (clipped to 6);
  a bad WRITE lkey is LOC_QP_OP_ERR after packets moved (checked before
  posting instead); ``max_qp_wr`` is 1M (queues halve until they fit).
"""

from __future__ import annotations

from ..base import Backend, BackendOptions
from ..options import VerbsOptions
from .facts import ProbeReport

__all__ = ["VerbsOptions", "open_backend", "probe"]


def open_backend(options: BackendOptions) -> Backend:
    """Open the RDMA device ``options`` names (or the first with an ACTIVE port)."""
    from .backend import VerbsBackend

    return VerbsBackend(options)


def probe(port: int | None = None) -> ProbeReport:
    """What this node's RDMA stack looks like, for ``doctor``; never raises."""
    from .probe import run_probe

    return run_probe(port)
