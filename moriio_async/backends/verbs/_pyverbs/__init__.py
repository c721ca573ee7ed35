"""The one package that imports pyverbs (``lib`` loads it). Everything else in the backend goes through it.

pyverbs has no type stubs, so ``Any`` stays in here: each wrapper takes and
returns plain typed values, and every pyverbs exception becomes a ``VerbsError``
(or ``BackendUnavailable``) carrying the errno. ``lib`` imports pyverbs and its
errors, ``device`` wraps the context, PD, MRs and CQs, ``qp`` the queue pair and
its posting (extended QP sections; see ``QpHandle.post``).

Facts about pyverbs 59 that this package relies on (read in rdma-core 59's
``pyverbs/*.pyx``, checked on rxe):

* ``MR(pd, length, access, address=addr)`` registers memory the caller owns
  (``is_user_addr``: pyverbs neither allocates nor frees it).
* ``CompChannel.fd`` exists from rdma-core 57 on. ``get_cq_event`` raises
  ``PyverbsRDMAError`` with ``error_code == EAGAIN`` on a non-blocking fd with
  nothing pending; every event taken must be acknowledged (``ack_events``).
* ``Context.get_async_event`` is a blocking ``read()`` made WITH the GIL held:
  called on an idle device it would freeze every Python thread. pyverbs does
  not expose the async fd either, so ``open_context`` finds it (the
  ``anon_inode:[infinibandevent]`` fd that ``ibv_open_device`` creates), makes it
  non-blocking, and the watcher thread waits on it with ``select.poll`` (which
  releases the GIL) before calling ``get_async_event``.
* ``AsyncEvent`` exposes only ``event_type``: not which QP, CQ or port.
* ``SGE`` and ``SendWR`` malloc their C arrays and, in 59 (misspelled
  ``__dealloc``), free them only in ``close()``; ``qp`` calls it once
  (later releases null the pointer, so the second free is harmless there).
* Importing ``pyverbs.base`` calls ``logging.basicConfig`` on the root logger;
  ``lib`` undoes that.
"""

from .device import Context, CqHandle, MrHandle, PdHandle
from .lib import PYVERBS_VERSION, has_channel_fd, list_devices
from .qp import QpHandle

__all__ = [
    "PYVERBS_VERSION",
    "Context",
    "CqHandle",
    "MrHandle",
    "PdHandle",
    "QpHandle",
    "has_channel_fd",
    "list_devices",
]
