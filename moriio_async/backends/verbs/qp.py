"""The verbs RC queue pair: endpoint exchange, INIT->RTR->RTS, posting a chunk per call with slot accounting."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ...errors import InvalidArgument
from ...status import Access, Opcode, WcStatus
from ...work import WorkBatch
from ..base import TAG_SHIFT, Endpoint, QpState, QueuePair, SendQueueFull
from ._pyverbs import Context, PdHandle, QpHandle
from .checks import covers, first_bad_local
from .cq import VerbsCompletionQueue
from .facts import LINK_LAYER_ETHERNET, DeviceLimits, PortFacts
from .faults import PairFaults, VerbsFaultSeam
from .ledger import FENCE_WR_ID, SendLedger
from .memory import VerbsMemoryRegion
from .values import PathParams, VerbsError

__all__ = ["PortConfig", "VerbsQueuePair"]

log = logging.getLogger("moriio_async.verbs")

# enum ibv_qp_state -> the contract's names (SQD drains but still sends; SQE is an error).
_STATES = {0: QpState.RESET, 1: QpState.INIT, 2: QpState.RTR, 3: QpState.RTS, 4: QpState.RTS}
QPS_SQE, QPS_ERR = 5, 6
_MAX_RD_ATOM = 16
# retry_cnt is 3 bits, but rxe (and some providers) read 7 as "retry forever", like rnr_retry:
# a dead peer would then never become RETRY_EXC_ERR, which the contract promises. 6 is the most.
_MAX_RETRY_CNT = 6
_WRITE, _READ = int(Opcode.RDMA_WRITE), int(Opcode.RDMA_READ)
_MAX_SGE_BYTES = (1 << 32) - 1


@dataclass(frozen=True, slots=True)
class PortConfig:
    """What every pair of one backend shares: the port, its GID, the limits and the retry knobs."""

    port: PortFacts
    gid_index: int
    gid: str
    limits: DeviceLimits
    timeout: int
    retry_cnt: int
    rnr_retry: int


def _int_field(remote: Endpoint, name: str, low: int, high: int) -> int:
    value: Any = remote.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidArgument(f"remote endpoint field {name!r} is missing or out of range: {value!r}")
    return value


class VerbsQueuePair(QueuePair):
    def __init__(
        self,
        ctx: Context,
        pd: PdHandle,
        cq: VerbsCompletionQueue,
        config: PortConfig,
        regions: Callable[[int], VerbsMemoryRegion | None],
        *,
        depth: int,
        max_sge: int,
        extended: bool = True,
        faults: VerbsFaultSeam | None = None,
        qp_tag: int = 0,
    ) -> None:
        access = int(Access.all())
        # One slot more than offered: room for the fence (see _fail_from).
        self.handle = QpHandle(
            ctx,
            pd,
            cq.handle,
            depth=depth + 1,
            max_sge=max_sge,
            port=config.port.port,
            access=access,
            extended=extended,
        )
        self._regions = regions
        self.cq = cq
        self.config = config
        self.qpn = self.handle.qp_num
        """The device's number for the pair: in its completions, its ledger and its endpoint."""
        self.qp_num = qp_tag << TAG_SHIFT | self.qpn
        """The engine's number for it: the device's, with the backend's tag above (``BackendOptions.qp_tag``)."""
        self.max_send_wr = min(depth, self.handle.max_send_wr - 1)
        self.max_sge = min(max_sge, self.handle.max_send_sge)
        self.ledger = SendLedger(self.qpn, self.max_send_wr)
        cq.ledgers[self.qpn] = self.ledger
        self.lock = threading.Lock()
        """Held by ``close`` and by the event watcher, so no thread touches a destroyed pair."""
        self.closed = False
        self.faults: PairFaults | None = None
        """A fault plan's hold on this pair (tests and ``moriio-async faults`` only)."""
        if faults is not None:
            self.faults = PairFaults(
                faults, self.qpn, post=self._post_now, fail=self._fail_from,
                outstanding=lambda: self.ledger.outstanding, dead=lambda: self.ledger.dead, wake=cq.wake,
            )  # fmt: skip
            cq.fault_hooks[self.qpn] = self.faults.due
        self._psn = secrets.randbits(24)
        self._rd_atom = max(1, min(config.limits.max_qp_rd_atom, _MAX_RD_ATOM))

    @property
    def state(self) -> QpState:
        with self.lock:
            if self.closed:
                return QpState.ERR
            try:
                raw = self.handle.query_state()
            except VerbsError:
                return QpState.ERR
        return _STATES.get(raw, QpState.ERR)

    def endpoint(self) -> Endpoint:
        port = self.config.port
        return {
            "qpn": self.qpn,
            "psn": self._psn,
            "gid": self.config.gid,
            "lid": port.lid,
            "mtu": port.active_mtu,
            "rd_atom": self._rd_atom,
        }

    def connect(self, remote: Endpoint) -> None:
        qpn = _int_field(remote, "qpn", 1, (1 << 24) - 1)
        psn = _int_field(remote, "psn", 0, (1 << 24) - 1)
        lid = _int_field(remote, "lid", 0, 0xFFFF)
        mtu = _int_field(remote, "mtu", 1, 5)
        rd_atom = remote.get("rd_atom", 1)
        gid = remote.get("gid")
        try:
            ipaddress.IPv6Address(str(gid))
        except ValueError as exc:
            raise InvalidArgument(f"remote endpoint has no valid 'gid': {gid!r}") from exc
        cfg = self.config
        limits = cfg.limits
        init_rd = min(limits.max_qp_init_rd_atom, _MAX_RD_ATOM)
        if isinstance(rd_atom, int) and not isinstance(rd_atom, bool) and rd_atom > 0:
            init_rd = min(init_rd, rd_atom)
        params = PathParams(
            port=cfg.port.port,
            sgid_index=cfg.gid_index,
            dgid=str(gid),
            dlid=lid,
            is_global=cfg.port.link_layer == LINK_LAYER_ETHERNET or lid == 0,
            dest_qp_num=qpn,
            rq_psn=psn,
            sq_psn=self._psn,
            path_mtu=min(mtu, cfg.port.active_mtu),
            max_dest_rd_atomic=self._rd_atom,
            max_rd_atomic=max(1, init_rd),
            timeout=max(0, min(cfg.timeout, 31)),
            retry_cnt=max(0, min(cfg.retry_cnt, _MAX_RETRY_CNT)),
            rnr_retry=max(0, min(cfg.rnr_retry, 7)),
        )
        self.handle.connect(params)
        log.debug("QP %d connected to QP %d (gid %s, mtu enum %d)", self.qpn, qpn, gid, params.path_mtu)

    def post(self, batch: WorkBatch) -> None:
        n = len(batch)
        if not n:
            return
        # Shape checks in few array calls (each costs 100-300 us under emulation). Opcodes are 0
        # (WRITE) or 4 (READ), so OR-ed together they give no other bit; with as many entries as
        # requests and none empty, each request has exactly one (no max to check).
        m = len(batch.sge_addr)
        counts = np.diff(batch.sge_start)
        fits = int(counts.min()) >= 1 and (m == n or int(counts.max()) <= self.max_sge)
        ops = int(np.bitwise_or.reduce(batch.opcode))
        if ops & ~(_WRITE | _READ) or not fits or int(batch.sge_length.max()) > _MAX_SGE_BYTES:
            raise InvalidArgument(self._shape_error(batch, counts))
        ledger = self.ledger
        free = ledger.free - (0 if self.faults is None else self.faults.waiting)
        if n > free:
            raise SendQueueFull(
                f"QP {self.qpn}: {n} requests, {free} of {ledger.depth} slots free ({ledger.describe()})"
            )
        if self.faults is not None:
            self.faults.submit(batch)  # it posts through _post_now what the plan lets through
        else:
            self._post_now(batch)

    def post_one(
        self, wr_id: int, opcode: Opcode, local_addr: int, lkey: int, remote_addr: int, rkey: int, length: int
    ) -> None:
        """The single read or write on plain integers: the same checks, ledger record and outcome as
        ``post`` of ``WorkBatch.one``, without its arrays. Under emulation every numpy call costs
        100-300 us and the batch path makes about a dozen for one request. Anything unusual (a
        fault plan, a pair that only makes up completions, a request a check refuses, a full
        queue) takes ``post`` of the batch, which refuses it or fails it in order the long way."""
        ledger = self.ledger
        region = self._regions(lkey)
        if (
            self.faults is not None
            or self.closed
            or ledger.must_synthesize
            or ledger.free < 1
            or (opcode != _WRITE and opcode != _READ)
            or length > _MAX_SGE_BYTES
            or region is None
            or not covers(region, local_addr, length, write=opcode == _READ)
        ):
            super().post_one(wr_id, opcode, local_addr, lkey, remote_addr, rkey, length)
            return
        read = opcode == _READ
        error = self.handle.post_one(wr_id, read, local_addr, lkey, remote_addr, rkey, length)
        if error is None:
            ledger.posted_one(wr_id, Opcode.RDMA_READ if read else Opcode.RDMA_WRITE, length)
        else:  # nothing of it was posted (a failed ibv_wr_complete posts nothing of its section)
            self._refused(WorkBatch.one(wr_id, opcode, local_addr, lkey, remote_addr, rkey, length), 0, error)

    def _post_now(self, batch: WorkBatch) -> None:
        n, ledger = len(batch), self.ledger
        if ledger.must_synthesize or self.closed:
            ledger.refused(batch, WcStatus.WR_FLUSH_ERR)
            self.cq.wake()
            return
        # Local SGEs are checked here, not by the device: rxe reports a bad lkey on a WRITE as
        # LOC_QP_OP_ERR and moves the packets before a bad one, so a request that would fail
        # locally never reaches the wire and fails LOC_PROT_ERR, in order, with nothing moved.
        bad = first_bad_local(batch, self._regions)
        good = n if bad is None else bad
        taken, error = self.handle.post(batch, good) if good else (0, None)
        ledger.posted(batch, taken)
        if error is not None:
            self._refused(batch, taken, error)
        elif bad is not None:
            self._fail_from([(batch, good)], WcStatus.LOC_PROT_ERR)

    def _refused(self, batch: WorkBatch, taken: int, error: VerbsError) -> None:
        """The device refused request ``taken`` of ``batch``: it fails (a flush if the pair is in
        error already) and the rest flush after it."""
        in_error = self.hw_state() in (QPS_ERR, QPS_SQE, None)
        status = WcStatus.WR_FLUSH_ERR if in_error else WcStatus.LOC_QP_OP_ERR
        log.warning("QP %d refused request %d of %d (%s): it ends %s", self.qpn, taken, len(batch), error,
                    status.name)  # fmt: skip
        self._fail_from([(batch, taken)], status)

    def _shape_error(self, batch: WorkBatch, counts: npt.NDArray[np.int64]) -> str:
        for i, k in enumerate(counts.tolist()):
            wr_id = batch.wr_id + i
            if not 1 <= k <= self.max_sge:
                return f"work request {wr_id} has {k} SGEs (1..{self.max_sge})"
            if int(batch.opcode[i]) not in (_WRITE, _READ):
                return f"work request {wr_id} has opcode {int(batch.opcode[i])!r}"
            a = int(batch.sge_start[i])
            if int(batch.sge_length[a : a + k].max()) > _MAX_SGE_BYTES:
                return (
                    f"work request {wr_id} has a scatter entry over {_MAX_SGE_BYTES} bytes (ibv_sge.length is 32-bit)"
                )
        raise AssertionError("no bad request found")  # pragma: no cover

    def _fail_from(self, parts: list[tuple[WorkBatch, int]], status: WcStatus) -> None:
        """Requests ``start:`` of each ``(batch, start)`` never reached the device: the first ends
        with ``status``, the others flush.

        The pair is moved to ERR (the contract: after an error every request flushes) and a
        fence is posted, whose flush completion covers earlier unsignaled requests, so the
        made-up completions are delivered right after the hardware's own, in order.
        """
        for batch, start in parts:
            self.ledger.refused(batch, status, start)
            status = WcStatus.WR_FLUSH_ERR
        failure: VerbsError | None = None
        with self.lock:
            if not self.closed:
                try:
                    self.handle.to_error()
                    failure = self.handle.post_fence(FENCE_WR_ID)
                except VerbsError as exc:
                    failure = exc
                if failure is None:
                    self.ledger.fence()
                    self.cq.wake()
                    return
        log.warning("QP %d: cannot fence after a refused request (%s): flushing from the ledger", self.qpn, failure)
        self.cq.request_kill(self.qpn, WcStatus.WR_FLUSH_ERR)

    def to_error(self) -> None:
        if self.faults is not None:
            self.faults.abort()  # requests a fault plan still holds flush after the device's (at the next poll)
        with self.lock:
            if self.closed:
                return
            try:
                self.handle.to_error()
                return
            except VerbsError as exc:
                log.warning("QP %d: cannot move to ERR (%s): flushing from the ledger", self.qpn, exc)
        self.cq.request_kill(self.qpn, WcStatus.WR_FLUSH_ERR)

    def close(self) -> None:
        if self.faults is not None and not self.closed:
            self.faults.fail_all()
            self.faults.close()
        with self.lock:
            if self.closed:
                return
            with contextlib.suppress(VerbsError):
                self.handle.to_error()
            self.closed = True
            self.ledger.closed = True
            try:
                self.handle.close()
            finally:
                if self.ledger.held:
                    self.cq.request_kill(self.qpn, WcStatus.WR_FLUSH_ERR)

    def hw_state(self) -> int | None:
        """The state the device reports for this pair (QPS_*), or None once closed or unreadable."""
        with self.lock:
            if self.closed:
                return None
            try:
                return self.handle.query_state()
            except VerbsError:
                return None
