"""The verbs backend: one opened RDMA device, its PD, and the objects made from it."""

from __future__ import annotations

import errno
import logging
import threading
import time
from typing import ClassVar

from ...errors import BackendUnavailable, InvalidArgument
from ...status import Access, WcStatus
from ..base import Backend, BackendOptions, CompletionQueue, MemoryRegion, QueuePair, specific_options
from ..described import VerbsFacts
from ..options import VerbsOptions
from . import memory
from ._pyverbs import PYVERBS_VERSION, Context, PdHandle, has_channel_fd, list_devices
from .cq import VerbsCompletionQueue
from .events import EVENT_NAMES, AsyncEventWatcher
from .facts import GID_TYPE_NAMES, PORT_STATE_NAMES
from .faults import VerbsFaultSeam
from .gid import choose_gid
from .qp import QPS_ERR, QPS_SQE, PortConfig, VerbsQueuePair
from .values import VerbsError

__all__ = ["VerbsBackend"]

log = logging.getLogger("moriio_async.verbs")

_QP_EVENTS = {1, 2, 3, 7}  # QP_FATAL, QP_REQ_ERR, QP_ACCESS_ERR, PATH_MIG_ERR
_EVENT_CQ_ERR, _EVENT_DEVICE_FATAL, _EVENT_PORT_ERR = 0, 8, 10


def _open_device(options: VerbsOptions) -> Context:
    names = list_devices()
    if options.device is not None:
        if options.device not in names:
            raise BackendUnavailable(
                f"RDMA device {options.device!r} not found (devices: {', '.join(names)})",
                hint="pass one of the listed names as device=, or leave it unset for the first ACTIVE one",
            )
        return Context(options.device)
    seen = []
    for name in names:
        ctx = Context(name)
        try:
            state = ctx.port(options.ib_port).state_name
        except VerbsError as exc:
            state = f"unqueryable ({exc})"
        if state == "ACTIVE":
            return ctx
        seen.append(f"{name} port {options.ib_port}: {state}")
        ctx.close()
    raise BackendUnavailable(
        "no RDMA device has an ACTIVE port (" + "; ".join(seen) + ")",
        hint="bring the device's network interface up (ip link set <netdev> up), or use backend='tcp'",
    )


class VerbsBackend(Backend):
    name: ClassVar[str] = "verbs"

    def __init__(self, options: BackendOptions) -> None:
        self.options = options
        own = self.own = specific_options(options, VerbsOptions)
        self.flush_grace = own.flush_grace
        self.extended_qp = own.extended_qp
        """False: plain queue pairs, one ibv_post_send per request (what a provider without
        ``ibv_qp_ex`` send ops gets anyway); for tests and measurements."""
        self.fault_seam = None if own.plan is None else VerbsFaultSeam(own.plan, options.retry_timeout)
        self.ctx = _open_device(own)
        try:
            self._setup(options)
        except BaseException:
            self.ctx.close()
            raise

    def _setup(self, options: BackendOptions) -> None:
        self.limits = self.ctx.limits()
        port = self.ctx.port(self.own.ib_port)
        if not port.active:
            raise BackendUnavailable(
                f"{self.ctx.name} port {self.own.ib_port} is {PORT_STATE_NAMES.get(port.state, port.state)}",
                hint="bring the device's network interface up, or choose another device/ib_port",
            )
        choice = choose_gid(port.gids, link_layer=port.link_layer, requested=self.own.gid_index, host=options.host)
        log.info(
            "verbs: device %s port %d, GID index %d (%s %s): %s",
            self.ctx.name,
            port.port,
            choice.entry.index,
            choice.entry.type_name,
            choice.entry.gid,
            choice.reason,
        )
        self.gid_reason = choice.reason
        self.config = PortConfig(
            port=port,
            gid_index=choice.entry.index,
            gid=choice.entry.gid,
            limits=self.limits,
            timeout=self.own.qp_timeout,
            retry_cnt=self.own.retry_cnt,
            rnr_retry=self.own.rnr_retry,
        )
        self.pd = PdHandle(self.ctx)
        self._lock = threading.Lock()
        self._cqs: list[VerbsCompletionQueue] = []
        self._qps: dict[int, VerbsQueuePair] = {}
        self._regions: list[memory.VerbsMemoryRegion] = []
        self._lkeys: dict[int, memory.VerbsMemoryRegion] = {}
        self._suspects: dict[int, float] = {}
        self._closed = False
        self.watcher: AsyncEventWatcher | None = None
        if self.ctx.async_fd is None:
            log.warning("verbs: the device's async-event fd was not found: port/QP/device events are not watched")
        else:
            self.watcher = AsyncEventWatcher(self.ctx, self._on_event, self._on_tick)
            self.watcher.start()

    # -- the contract -----------------------------------------------------------------------

    def register_memory(self, buffer: memoryview, access: Access) -> MemoryRegion:
        self._check_open()
        region = memory.register(self.pd, buffer, access)
        self._regions.append(region)
        self._lkeys[region.lkey] = region
        return region

    def deregister_memory(self, region: MemoryRegion) -> None:
        memory.deregister(region)
        if region in self._regions:
            self._regions.remove(region)
        if self._lkeys.get(region.lkey) is region:
            del self._lkeys[region.lkey]

    def create_cq(self, depth: int) -> CompletionQueue:
        self._check_open()
        cq = VerbsCompletionQueue(self.ctx, max(1, min(depth, self.limits.max_cqe)))
        with self._lock:
            self._cqs.append(cq)
        return cq

    def create_qp(self, cq: CompletionQueue) -> QueuePair:
        self._check_open()
        if not isinstance(cq, VerbsCompletionQueue) or cq not in self._cqs:
            raise InvalidArgument("create_qp needs a completion queue of this verbs backend")
        depth = max(1, min(self.options.sq_depth, self.limits.max_qp_wr - 1))  # -1: the fence's slot
        sge = max(1, min(self.options.max_sge, self.limits.max_sge))
        while True:
            try:
                qp = VerbsQueuePair(
                    self.ctx, self.pd, cq, self.config, self._lkeys.get, depth=depth, max_sge=sge,
                    extended=self.extended_qp, faults=self.fault_seam, qp_tag=self.options.qp_tag,
                )  # fmt: skip
                break
            except VerbsError as exc:
                # max_qp_wr is what the device can index, not what memory allows: rxe says
                # 1M, and 1M WQEs of 32 SGEs is ~600 MB. Halve until the queue fits.
                if exc.errno != errno.ENOMEM or depth <= 64:
                    raise
                log.warning("verbs: a send queue of %d requests does not fit (%s); trying %d", depth, exc, depth // 2)
                depth //= 2
        with self._lock:
            for stale in [n for n, q in self._qps.items() if q.closed]:
                del self._qps[stale]
            self._qps[qp.qp_num] = qp
            on_cq = sum(q.max_send_wr + 1 for q in self._qps.values() if q.cq is cq)
        if on_cq > cq.handle.depth:
            # rxe drops completions past a full CQ silently (then CQ_ERR): every request,
            # signaled or not, may need an entry once the pair fails and flushes.
            log.warning(
                "verbs: %d send-queue slots now complete into a CQ of %d entries: size the CQ for all of them",
                on_cq, cq.handle.depth,
            )  # fmt: skip
        return qp

    def describe(self) -> VerbsFacts:
        port = self.config.port
        return VerbsFacts(
            backend="verbs",
            pyverbs=PYVERBS_VERSION,
            completion_channel_fd=has_channel_fd(),
            device=self.ctx.name,
            port=port.port,
            port_state=port.state_name,
            mtu=port.mtu_bytes,
            gid_index=self.config.gid_index,
            gid=self.config.gid,
            gid_type=next(
                (GID_TYPE_NAMES.get(g.gid_type) for g in port.gids if g.index == self.config.gid_index), None
            ),
            gid_reason=self.gid_reason,
            max_qp_wr=self.limits.max_qp_wr,
            max_sge=self.limits.max_sge,
            max_cqe=self.limits.max_cqe,
            max_qp_rd_atom=self.limits.max_qp_rd_atom,
            async_events=self.watcher is not None,
            fault_plan=None if self.fault_seam is None else self.fault_seam.describe(),
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.watcher is not None:
            self.watcher.stop()
        with self._lock:
            qps, self._qps = list(self._qps.values()), {}
            cqs, self._cqs = list(self._cqs), []
        for qp in qps:
            qp.to_error()
        for qp in qps:
            qp.close()
        for cq in cqs:
            cq.close()
        for region in list(self._regions):
            memory.deregister(region)
        self._regions.clear()
        self._lkeys.clear()
        self.pd.close()
        self.ctx.close()

    # -- device events (watcher thread) -------------------------------------------------------

    def _on_event(self, kind: int) -> None:
        name = EVENT_NAMES.get(kind, str(kind))
        with self._lock:
            qps = [qp for qp in self._qps.values() if not qp.closed]
        if kind == _EVENT_PORT_ERR:
            log.warning("verbs: %s port went down (PORT_ERR): failing %d queue pairs", self.ctx.name, len(qps))
            for qp in qps:
                qp.to_error()
                self._suspect(qp)
        elif kind in (_EVENT_DEVICE_FATAL, _EVENT_CQ_ERR):
            # The hardware will not deliver again: fail from the ledgers at once.
            log.error("verbs: %s on %s: failing every queue pair", name, self.ctx.name)
            for qp in qps:
                qp.to_error()
                qp.cq.request_kill(qp.qpn, WcStatus.FATAL_ERR)
        elif kind in _QP_EVENTS:
            # pyverbs does not say which pair: look for the ones the device moved to an error state.
            for qp in qps:
                state = qp.hw_state()
                if state in (QPS_ERR, QPS_SQE, None):
                    log.warning("verbs: %s: QP %d is in error; its requests flush", name, qp.qpn)
                    if state == QPS_SQE:
                        qp.to_error()
                    self._suspect(qp)
        else:
            log.info("verbs: device event %s on %s", name, self.ctx.name)

    def _suspect(self, qp: VerbsQueuePair) -> None:
        self._suspects.setdefault(qp.qp_num, time.monotonic() + self.flush_grace)

    def _on_tick(self) -> None:
        """Safety net: a pair in error whose hardware has not flushed within the grace is flushed by us."""
        now = time.monotonic()
        for qp_num, deadline in list(self._suspects.items()):
            qp = self._qps.get(qp_num)
            if qp is None or qp.ledger.outstanding == 0:
                del self._suspects[qp_num]
            elif now >= deadline:
                del self._suspects[qp_num]
                log.warning(
                    "verbs: QP %d did not flush within %.1fs: completing from the ledger", qp_num, self.flush_grace
                )
                qp.cq.request_kill(qp.qpn, WcStatus.WR_FLUSH_ERR)

    def _check_open(self) -> None:
        if self._closed:
            raise BackendUnavailable("the verbs backend is closed")
