"""The backend contract: a verbs-shaped NIC, with no asyncio.

A backend is what one engine opens on one device. It registers memory, makes
completion queues and reliable-connected queue pairs, and carries RDMA READ
and WRITE work requests. The asyncio layer above sees only this module.

The semantics every backend keeps (the conformance suite checks them):

* Memory: ``register_memory`` takes a writable, C-contiguous buffer and
  returns a region whose ``addr`` is the buffer's address; remote requests
  name ``addr + offset`` and the region's ``rkey``. A request outside a live
  region, with a wrong rkey, or without the access it needs, completes with
  ``REM_ACCESS_ERR`` at the initiator and changes no byte at the target.
* Completion queue: ``fileno()`` is a real file descriptor (a completion
  channel). After ``req_notify()`` the next completion added makes it
  readable, once (like ``ibv_req_notify_cq``). ``get_event()`` consumes and
  acknowledges what is pending and never blocks. A reader that does
  get_event, req_notify, then polls until empty never misses a completion.
* Queue pair (RC): completions come in posting order. A successful request
  completes only if it was signaled; a failed or flushed one always
  completes. After the first error the pair is in the error state and every
  outstanding and later request completes with ``WR_FLUSH_ERR``. A peer that
  vanishes makes the oldest outstanding request complete with
  ``RETRY_EXC_ERR`` (Soft-RoCE with both ends on one device says
  ``REM_ACCESS_ERR``: it sees the peer's pair destroyed), the rest with
  ``WR_FLUSH_ERR``. A send-queue slot is
  held from ``post`` until the completion that covers the request (its
  own, or a later signaled one on the same pair) has been polled.
* Batches: ``post`` takes a ``WorkBatch`` (arrays, consecutive wr_ids) and
  posts it all or nothing. A backend keeps the batch as arrays as far as it
  can (one doorbell, one header pass, one vectorised check), so the cost of
  a batch grows with its bytes and its signaled requests, not with Python
  objects per request. Only signaled requests and failures make
  completions, so accounting a batch above is O(signaled), not O(requests).
  ``post_one`` is the single read or write, one signaled request with one
  scatter entry, as plain integers: exactly ``post`` of that one-request
  batch (the default builds it), for a backend to serve without arrays.
* A fatal condition a backend learns of off the event loop (device event,
  dead connection) is reported through the completion queue as completions,
  never as an exception in some other thread.
* Connecting: the active side (the one that will post) creates its pair
  and sends ``endpoint()`` to the passive side; the passive side creates a
  pair, ``connect``s it to that endpoint and answers with its own endpoint;
  then the active side ``connect``s. The runtime posts only on the active
  side's pair; the passive pair only answers (a backend may refuse posts
  on it). Before ``connect`` the runtime calls ``bind_session`` on both
  pairs: the answering (passive) pair is told so, and **never dials**
  whatever the endpoint it is given says (a backend whose connect could
  open a connection refuses such an endpoint with ``InvalidArgument``), so
  a peer cannot make a target open connections to addresses of its
  choosing; its ``connect`` does no network I/O. A backend whose pairs connect with a token (TCP) derives it
  from the session key given there, so only the peer that proved the
  shared secret on that control link can connect.
* Exports: a region is reachable by peers only once ``export_memory`` was
  called for it (the engine exports regions registered with a name, or
  explicitly). A backend that can refuse the rest at the target does
  (TCP: an unexported region's rkey is unknown on its data plane); others
  rely on rkeys reaching only the peers given the descriptor.
* Calls may block only where documented: ``QueuePair.connect`` (the runtime
  calls it in a worker thread) and ``Backend.close``.
"""

from __future__ import annotations

import abc
import enum
import mmap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

from ..errors import InvalidArgument, MoriioError
from ..status import Access, Opcode
from ..work import WorkBatch, WorkCompletion, WorkRequest
from .described import BackendFacts

__all__ = [
    "QP_MASK",
    "TAG_SHIFT",
    "Backend",
    "BackendOptions",
    "CompletionQueue",
    "MemoryRegion",
    "QpState",
    "QueuePair",
    "SendQueueFull",
    "check_number",
    "specific_options",
]

TAG_SHIFT = 24
"""A queue-pair number's bits above these say which of an engine's backends the pair is on
(``BackendOptions.qp_tag``); the engine's completion router keeps one table per backend."""
QP_MASK = (1 << TAG_SHIFT) - 1
"""The bits of a queue-pair number that a backend counts in."""

Endpoint = Mapping[str, str | int | bool]
"""What one side of a queue pair tells the other to connect: a flat map of scalars, as the control
messages carry it (``core.protocol.Endpoint`` bounds its size on the wire)."""


class SendQueueFull(MoriioError):
    """``post_send`` found no room for every request: none was posted.

    The runtime keeps its own count of free slots, so this is a safety net that
    means the runtime and the backend disagree, not ordinary backpressure.
    """


@dataclass(frozen=True, slots=True)
class BackendOptions:
    """Settings a backend reads at open time: those every backend may use, and its own in ``specific``."""

    host: str = "127.0.0.1"
    """Address the data plane listens on (TCP) or whose GID is used (verbs)."""
    sq_depth: int = 256
    """Requested send-queue depth; a backend clips it to what the device allows."""
    max_sge: int = 16
    """Most scatter/gather entries per work request; a backend clips it to what the device allows."""
    retry_timeout: float = 5.0
    """Silence after which an outstanding request fails with RETRY_EXC_ERR."""
    connect_timeout: float = 10.0
    """Seconds a queue pair's connection to its peer may take."""
    hello_timeout: float = 5.0
    """TCP: seconds from the accept for a data connection's whole hello (at most ``connect_timeout``)."""
    max_failures_per_source: int = 16
    """TCP: unknown tokens and refused remote accesses one source may cause within ``failure_lockout``
    before each of its data connections waits a quarter of the hello deadline, for ``failure_lockout`` seconds."""
    failure_lockout: float = 30.0
    """TCP: the window ``max_failures_per_source`` counts over, and how long a source over it stays delayed
    (seconds)."""
    qp_tag: int = 0
    """The backend's place among its engine's (0: the first): its pairs are numbered
    ``qp_tag << TAG_SHIFT | n``, so no two backends of one engine hand out the same number. Their
    completions carry at least the low ``TAG_SHIFT`` bits (verbs: the device's number; the
    software NICs: the whole one), which is what the engine's router looks them up by."""
    specific: object = None
    """The backend's own options (``TcpOptions``, ``VerbsOptions``, ``CmaOptions``, ``MockOptions`` of its
    package); None: its defaults. Another backend's options are refused at open (``specific_options``)."""


OptionsT = TypeVar("OptionsT")


def specific_options(options: BackendOptions, kind: type[OptionsT]) -> OptionsT:
    """``options.specific`` if it is a ``kind``, ``kind()`` if None; ``InvalidArgument`` otherwise."""
    given = options.specific
    if given is None:
        return kind()
    if not isinstance(given, kind):
        raise InvalidArgument(f"BackendOptions.specific must be a {kind.__name__} here, not {type(given).__name__}")
    return given


def check_number(owner: str, name: str, value: object, low: float, high: float, *, whole: bool = True) -> None:
    """``InvalidArgument`` naming ``owner.name`` unless ``value`` is a number (an int if ``whole``) in low..high."""
    kinds = int if whole else int | float
    if not isinstance(value, kinds) or isinstance(value, bool) or not low <= value <= high:
        what = "an int" if whole else "a number"
        raise InvalidArgument(f"{owner}.{name} must be {what} in {low:g}..{high:g}, not {value!r}")


class QpState(enum.StrEnum):
    """Queue-pair states, named as in verbs (a ``str``: logs and endpoints show the name)."""

    RESET = "RESET"
    INIT = "INIT"
    RTR = "RTR"
    RTS = "RTS"
    ERR = "ERR"


@dataclass(eq=False, slots=True)
class MemoryRegion:
    """A registered buffer. Backends may subclass it to keep their handle."""

    addr: int
    length: int
    lkey: int
    rkey: int
    access: Access
    view: memoryview = field(repr=False)


class CompletionQueue(abc.ABC):
    """A completion queue with its completion channel."""

    @abc.abstractmethod
    def fileno(self) -> int:
        """The channel's file descriptor, non-blocking, readable when an event is pending.

        -1 means the backend has no channel fd (pyverbs older than 57): the
        runtime then polls this queue from the event loop, adaptively.
        """

    @abc.abstractmethod
    def req_notify(self) -> None:
        """Arm: the next completion added makes ``fileno()`` readable, once."""

    @abc.abstractmethod
    def get_event(self) -> bool:
        """Consume and acknowledge pending channel events; False when there were none."""

    @abc.abstractmethod
    def poll(self, max_entries: int = 64) -> list[WorkCompletion]:
        """Take up to ``max_entries`` completions, oldest first; never blocks."""

    @abc.abstractmethod
    def close(self) -> None:
        """Free the queue; its queue pairs must be closed first."""


class QueuePair(abc.ABC):
    """A reliable-connected queue pair."""

    qp_num: int
    max_send_wr: int
    """The real send-queue depth, after the device's limits."""
    max_sge: int
    gathers_singles: bool = False
    """Each post costs a fixed amount worth sharing (a system call and a wire chunk on tcp): with
    requests in flight, the runtime then posts the single reads and writes of one event-loop pass
    together, as one batch, at the end of that pass. False: each single is posted as it comes."""

    @property
    @abc.abstractmethod
    def state(self) -> QpState:
        """Where the pair is in its life (verbs' names)."""

    @abc.abstractmethod
    def endpoint(self) -> Endpoint:
        """What the peer's queue pair needs to connect to this one."""

    @abc.abstractmethod
    def connect(self, remote: Endpoint) -> None:
        """Bring the pair to RTS against the peer's endpoint. May block; call off the loop."""

    def bind_session(self, session_key: bytes | None, *, answering: bool) -> None:  # noqa: B027 (optional)
        """Before ``connect``: the session key of the authenticated control link this pair is set up
        over (None without a shared secret), and whether this is the answering (passive) side, which
        never dials. Backends that need neither ignore it (the default)."""

    @abc.abstractmethod
    def post(self, batch: WorkBatch) -> None:
        """Post a batch in order; all or none (``SendQueueFull``, ``InvalidArgument``). Never blocks."""

    def post_one(
        self, wr_id: int, opcode: Opcode, local_addr: int, lkey: int, remote_addr: int, rkey: int, length: int
    ) -> None:
        """Post one signaled request of ``length`` bytes between ``local_addr`` (one scatter entry) and
        ``remote_addr``: the same as ``post`` of ``WorkBatch.one`` of these values, which the default does."""
        self.post(WorkBatch.one(wr_id, opcode, local_addr, lkey, remote_addr, rkey, length))

    def post_send(self, wrs: Sequence[WorkRequest]) -> None:
        """Post ``WorkRequest`` values (consecutive wr_ids): ``post`` of the packed batch."""
        self.post(WorkBatch.from_requests(wrs))

    @abc.abstractmethod
    def to_error(self) -> None:
        """Move to the error state: every outstanding request completes with WR_FLUSH_ERR."""

    @abc.abstractmethod
    def close(self) -> None:
        """Destroy the pair (moving it to the error state first if needed)."""


class Backend(abc.ABC):
    """One opened device: the factory for regions, completion queues and queue pairs."""

    name: ClassVar[str]

    @abc.abstractmethod
    def register_memory(self, buffer: memoryview, access: Access) -> MemoryRegion:
        """Register a writable, C-contiguous, byte-formatted view (the caller checked it).

        REMOTE_WRITE without LOCAL_WRITE raises ``InvalidArgument``, as
        ``ibv_reg_mr`` refuses it (EINVAL), so no backend accepts what another refuses.
        """

    def allocate_buffer(self, size: int) -> mmap.mmap:
        """A zeroed, page-aligned buffer of ``size`` bytes, for ``register_memory``.

        The default is an anonymous private mapping. A backend that can share memory with
        peers on the same host (cma) backs it with a memfd those peers map, so they move its
        bytes with a plain copy.
        """
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise InvalidArgument(f"allocation size must be a positive int, not {size!r}")
        return mmap.mmap(-1, size)

    @abc.abstractmethod
    def deregister_memory(self, region: MemoryRegion) -> None:
        """Invalidate the region: later remote requests on it fail with REM_ACCESS_ERR.

        Once it returns, no request reads or writes the buffer again. It may
        wait, briefly, for a request moving the region's bytes right now
        (as ``ibv_dereg_mr`` does); the runtime avoids that by deregistering
        only regions with nothing in flight.
        """

    def export_memory(self, region: MemoryRegion) -> None:  # noqa: B027 (optional)
        """Make ``region`` reachable by peers (see Exports above). The default does nothing: the
        backend cannot refuse an unexported region at the target."""

    def scope(self) -> str:
        """Where this backend reaches, for peers choosing a transport: a peer uses it only if its own
        backend of the same name says the same. Empty (the default): any peer that has one."""
        return ""

    def watch_access_errors(self, listener: Callable[[int, str], None]) -> None:  # noqa: B027 (optional)
        """Have ``listener(qp_num, detail)`` called, from a NIC thread, each time a peer's request on
        answering pair ``qp_num`` is refused by the target's checks. The default never calls it."""

    @abc.abstractmethod
    def create_cq(self, depth: int) -> CompletionQueue:
        """A completion queue with its own completion channel."""

    @abc.abstractmethod
    def create_qp(self, cq: CompletionQueue) -> QueuePair:
        """A queue pair in INIT whose send completions go to ``cq``."""

    @abc.abstractmethod
    def describe(self) -> BackendFacts:
        """Facts for logs and ``doctor``: device, port, GID, limits (a ``BackendFacts`` of this backend's kind)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything; outstanding requests are flushed first."""
