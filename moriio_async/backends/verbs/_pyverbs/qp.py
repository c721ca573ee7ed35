"""The RC queue pair through pyverbs: connecting it, and posting a chunk of requests per call."""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import numpy as np

from ....status import Opcode
from ....work import WorkBatch, WorkRequest
from ..values import PathParams, VerbsError
from . import lib
from .device import Context, CqHandle, PdHandle

__all__ = ["QpHandle"]

log = logging.getLogger("moriio_async.verbs")

# ABI values from <infiniband/verbs.h>; stable across rdma-core releases.
_QPT_RC = 2
_QP_STATE_MASK = 1
_QPS_ERR = 6
_WR_RDMA_WRITE, _WR_RDMA_READ = 0, 4
_OP_READ = int(Opcode.RDMA_READ)
_SEND_SIGNALED = 2
_QP_INIT_ATTR_PD, _QP_INIT_ATTR_SEND_OPS_FLAGS = 1 << 0, 1 << 6
_QP_EX_WRITE_READ = (1 << 0) | (1 << 4)  # IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_READ


class _Sg(NamedTuple):
    """What ``QPEx.wr_set_sge_list`` reads from each entry (attributes ``addr``, ``length``, ``lkey``)."""

    addr: int
    length: int
    lkey: int


class QpHandle:
    """An RC queue pair with selective signaling (``sq_sig_all=0``), created in INIT.

    Extended (``QPEx``, send ops RDMA WRITE and READ) where the provider offers it, so a
    chunk of requests is built in one ``wr_start``/``wr_complete`` section: one doorbell,
    and a handful of Cython calls per request into one reused ``SGE``. Otherwise (a provider
    without ``ibv_qp_ex`` send ops) a plain QP, one ``ibv_post_send`` per request.
    """

    def __init__(
        self,
        ctx: Context,
        pd: PdHandle,
        cq: CqHandle,
        *,
        depth: int,
        max_sge: int,
        port: int,
        access: int,
        extended: bool = True,
    ) -> None:
        cap = lib.qp.QPCap(max_send_wr=depth, max_recv_wr=1, max_send_sge=max_sge, max_recv_sge=1)
        attr = lib.qp.QPAttr(port_num=port)
        attr.qp_access_flags = access
        attr.pkey_index = 0
        init: Any = None
        self.extended = False
        try:
            if not extended:
                raise lib.PyverbsError("not asked for (extra verbs_extended_qp=False)")
            init = lib.qp.QPInitAttrEx(
                qp_type=_QPT_RC, scq=cq.raw, rcq=cq.raw, cap=cap, sq_sig_all=0, pd=pd.raw,
                comp_mask=_QP_INIT_ATTR_PD | _QP_INIT_ATTR_SEND_OPS_FLAGS, send_ops_flags=_QP_EX_WRITE_READ,
            )  # fmt: skip
            self._qp: Any = lib.qp.QPEx(ctx.raw, init, attr)
            self.extended = True
        except lib.PyverbsError as exc:
            log.info("verbs: no extended QP on %s (%s): one ibv_post_send per request", ctx.name, exc)
            try:
                init = lib.qp.QPInitAttr(qp_type=_QPT_RC, scq=cq.raw, rcq=cq.raw, cap=cap, sq_sig_all=0)
                self._qp = lib.qp.QP(pd.raw, init, attr)
            except lib.PyverbsError as exc2:
                raise lib.fail(f"ibv_create_qp(depth={depth}, sge={max_sge})", exc2) from exc2
        self.qp_num = int(self._qp.qp_num)
        self.max_send_wr = int(init.max_send_wr)
        self.max_send_sge = int(init.max_send_sge)
        self._sge: Any = lib.wr.SGE(0, 0, 0)
        """The one scatter entry every single-SGE request is built from (``wr_set_sge`` copies it)."""

    def connect(self, p: PathParams) -> None:
        try:
            attr = lib.qp.QPAttr(port_num=p.port, path_mtu=p.path_mtu)
            attr.dest_qp_num = p.dest_qp_num
            attr.rq_psn = p.rq_psn
            attr.max_dest_rd_atomic = p.max_dest_rd_atomic
            attr.min_rnr_timer = p.min_rnr_timer
            if p.is_global:
                gr = lib.addr.GlobalRoute(dgid=lib.addr.GID(p.dgid), sgid_index=p.sgid_index, hop_limit=64)
                attr.ah_attr = lib.addr.AHAttr(port_num=p.port, is_global=1, gr=gr, dlid=p.dlid)
            else:
                attr.ah_attr = lib.addr.AHAttr(port_num=p.port, is_global=0, dlid=p.dlid)
            self._qp.to_rtr(attr)
            attr.timeout = p.timeout
            attr.retry_cnt = p.retry_cnt
            attr.rnr_retry = p.rnr_retry
            attr.sq_psn = p.sq_psn
            attr.max_rd_atomic = p.max_rd_atomic
            self._qp.to_rts(attr)
        except lib.PyverbsError as exc:
            raise lib.fail(f"QP {self.qp_num}: INIT->RTR->RTS", exc) from exc

    def query_state(self) -> int:
        """``enum ibv_qp_state`` as the device reports it now."""
        try:
            attr, _ = self._qp.query(_QP_STATE_MASK)
        except lib.PyverbsError as exc:
            raise lib.fail(f"QP {self.qp_num}: ibv_query_qp", exc) from exc
        return int(attr.qp_state)

    def to_error(self) -> None:
        try:
            attr = lib.qp.QPAttr()
            attr.qp_state = _QPS_ERR
            self._qp.modify(attr, _QP_STATE_MASK)
        except lib.PyverbsError as exc:
            raise lib.fail(f"QP {self.qp_num}: modify to ERR", exc) from exc

    def post(self, batch: WorkBatch, stop: int) -> tuple[int, VerbsError | None]:
        """Post requests ``0:stop`` of ``batch`` in order; (how many the device took, the error or None).

        Extended QP: one ``wr_start``/``wr_complete`` section for the run. A failed
        ``ibv_wr_complete`` posts nothing of its section (``man ibv_wr_post``), so "taken"
        is exact. A request whose scatter entries differ in length is posted alone with
        ``ibv_post_send`` between two sections: rdma-core 59's rxe ``wr_set_sge_list``
        takes the first entry's length times their number as the total (its loop never
        advances ``sg_list``: tools/guest/PYVERBS_NOTES.md), which moves the wrong bytes.
        It must not run inside a section: ``wr_start`` holds the send queue's spinlock,
        which ``ibv_post_send`` takes too (a deadlock).
        """
        if not self.extended:
            return self._post_each(batch, 0, stop)
        starts = batch.sge_start[: stop + 1].tolist()
        m = starts[-1]
        cols = (
            batch.opcode[:stop].tolist(),
            batch.remote_addr[:stop].tolist(),
            batch.rkey[:stop].tolist(),
            batch.signaled[:stop].tolist(),
        )
        sges = (batch.sge_addr[:m].tolist(), batch.sge_length[:m].tolist(), batch.sge_lkey[:m].tolist())
        odd: list[int] = []  # requests whose scatter entries differ in length
        if m != stop:
            lengths, first = batch.sge_length[:m], batch.sge_start[:stop]
            odd = np.flatnonzero(np.maximum.reduceat(lengths, first) != np.minimum.reduceat(lengths, first)).tolist()
        taken = 0
        for end in [*odd, stop]:
            if end > taken:
                try:
                    self._section(batch.wr_id, taken, end, cols, starts, sges)
                except lib.PyverbsError as exc:
                    return taken, lib.fail(f"QP {self.qp_num}: ibv_wr_complete", exc)
                taken = end
            if end < stop:
                done, error = self._post_each(batch, end, end + 1)
                taken += done
                if error is not None:
                    return taken, error
        return taken, None

    def post_one(
        self, wr_id: int, read: bool, addr: int, lkey: int, remote_addr: int, rkey: int, length: int
    ) -> VerbsError | None:
        """Post one signaled request with one scatter entry: None, or the error (then nothing was posted).

        Its own section of a handful of Cython calls, with no arrays to read. A plain QP posts the
        one-request batch through ``post``.
        """
        if not self.extended:
            op = Opcode.RDMA_READ if read else Opcode.RDMA_WRITE
            return self.post(WorkBatch.one(wr_id, op, addr, lkey, remote_addr, rkey, length), 1)[1]
        qp, sge = self._qp, self._sge
        sge.addr = addr
        sge.length = length
        sge.lkey = lkey
        qp.wr_start()
        try:
            qp.wr_id = wr_id
            qp.wr_flags = _SEND_SIGNALED
            if read:
                qp.wr_rdma_read(rkey, remote_addr)
            else:
                qp.wr_rdma_write(rkey, remote_addr)
            qp.wr_set_sge(sge)
        except BaseException:
            qp.wr_abort()
            raise
        try:
            qp.wr_complete()
        except lib.PyverbsError as exc:
            return lib.fail(f"QP {self.qp_num}: ibv_wr_complete", exc)
        return None

    def _section(self, first_id: int, lo: int, hi: int, cols: tuple[list[Any], ...], starts: list[int],
                 sges: tuple[list[int], list[int], list[int]]) -> None:  # fmt: skip
        qp, sge = self._qp, self._sge
        write, read, set_sge, set_list = qp.wr_rdma_write, qp.wr_rdma_read, qp.wr_set_sge, qp.wr_set_sge_list
        opcodes, remote, rkeys, signaled = cols
        addrs, lengths, lkeys = sges
        # Fields the provider keeps between requests are set only when they change.
        flags = length = lkey = -1
        qp.wr_start()
        try:
            for i in range(lo, hi):
                qp.wr_id = first_id + i
                if (f := _SEND_SIGNALED if signaled[i] else 0) != flags:
                    qp.wr_flags = flags = f
                (read if opcodes[i] == _OP_READ else write)(rkeys[i], remote[i])
                a, b = starts[i], starts[i + 1]
                if b - a == 1:
                    sge.addr = addrs[a]
                    if lengths[a] != length:
                        sge.length = length = lengths[a]
                    if lkeys[a] != lkey:
                        sge.lkey = lkey = lkeys[a]
                    set_sge(sge)
                else:  # equal lengths (see ``post``): correct on every provider
                    set_list(b - a, [_Sg(addrs[k], lengths[k], lkeys[k]) for k in range(a, b)])
        except BaseException:
            qp.wr_abort()
            raise
        qp.wr_complete()

    def _post_each(self, batch: WorkBatch, lo: int, hi: int) -> tuple[int, VerbsError | None]:
        """One ``ibv_post_send`` per request: after a chain fails part-way, pyverbs reports the bad
        request only by copying it over a caller's SendWR (its sg_list pointer too, which both
        would then free), so one at a time keeps "taken" exact."""
        for i in range(lo, hi):
            send_wr = self._send_wr(batch.request(i))
            try:
                self._qp.post_send(send_wr)
            except lib.PyverbsError as exc:
                return i - lo, lib.fail(f"QP {self.qp_num}: ibv_post_send", exc)
            finally:
                send_wr.close()
        return hi - lo, None

    def post_fence(self, wr_id: int) -> VerbsError | None:
        """A signaled zero-length WRITE, for a pair in ERR: the device flushes it, in order."""
        sge = lib.wr.SGE(0, 0, 0)
        send_wr = lib.wr.SendWR(wr_id=wr_id, opcode=_WR_RDMA_WRITE, num_sge=1, sg=[sge], send_flags=_SEND_SIGNALED)
        sge.close()
        send_wr.set_wr_rdma(0, 0)
        try:
            self._qp.post_send(send_wr)
        except lib.PyverbsError as exc:
            return lib.fail(f"QP {self.qp_num}: posting the fence", exc)
        finally:
            send_wr.close()
        return None

    @staticmethod
    def _send_wr(w: WorkRequest) -> Any:
        sges = [lib.wr.SGE(s.addr, s.length, s.lkey) for s in w.sges]
        opcode = _WR_RDMA_READ if w.opcode is Opcode.RDMA_READ else _WR_RDMA_WRITE
        flags = _SEND_SIGNALED if w.signaled else 0
        send_wr = lib.wr.SendWR(wr_id=w.wr_id, opcode=opcode, num_sge=len(sges), sg=sges, send_flags=flags)
        send_wr.set_wr_rdma(w.rkey, w.remote_addr)
        for sge in sges:
            sge.close()
        return send_wr

    def close(self) -> None:
        try:
            self._qp.close()
        except lib.PyverbsError as exc:
            raise lib.fail(f"QP {self.qp_num}: ibv_destroy_qp", exc) from exc
        finally:
            sge, self._sge = self._sge, None
            if sge is not None:
                sge.close()  # pyverbs frees without clearing the pointer: exactly once
