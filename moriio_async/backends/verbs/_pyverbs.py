"""The one module that imports pyverbs. Everything else in the package goes through it.

pyverbs has no type stubs, so ``Any`` stays in here: each wrapper takes and
returns plain typed values, and every pyverbs exception becomes a ``VerbsError``
(or ``BackendUnavailable``) carrying the errno.

Facts about pyverbs 59 that this module relies on (read in rdma-core 59's
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
  ``__dealloc``), free them only in ``close()``; this module calls it once
  (later releases null the pointer, so the second free is harmless there).
* Importing ``pyverbs.base`` calls ``logging.basicConfig`` on the root logger;
  this module undoes that.
"""

from __future__ import annotations

import errno as errno_mod
import importlib.metadata
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

from ...errors import BackendUnavailable
from ...status import Opcode
from ...work import WorkRequest
from .facts import DeviceLimits, GidEntry, PortFacts
from .values import INSTALL_HINT, NO_DEVICE_HINT, PathParams, RawCompletion, VerbsError, event_fds

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


def _import() -> tuple[Any, ...]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        import pyverbs
        import pyverbs.addr as addr
        import pyverbs.cq as cq
        import pyverbs.device as device
        import pyverbs.mr as mr
        import pyverbs.pd as pd
        import pyverbs.qp as qp
        import pyverbs.wr as wr
        from pyverbs.pyverbs_error import PyverbsError
    except ImportError as exc:
        raise BackendUnavailable(f"pyverbs cannot be imported: {exc}", hint=INSTALL_HINT) from exc
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return pyverbs, addr, cq, device, mr, pd, qp, wr, PyverbsError


_pyverbs, _addr, _cq, _device, _mr, _pd, _qp, _wr, _PyverbsError = _import()


def _version() -> str:
    try:
        return importlib.metadata.version("pyverbs")
    except importlib.metadata.PackageNotFoundError:
        return str(getattr(_pyverbs, "__version__", "") or "unknown (no package metadata)")


PYVERBS_VERSION: str = _version()

# ABI values from <infiniband/verbs.h>; stable across rdma-core releases.
_QPT_RC = 2
_QP_STATE_MASK = 1
_QPS_ERR = 6
_WR_RDMA_WRITE, _WR_RDMA_READ = 0, 4
_SEND_SIGNALED = 2

_open_lock = threading.Lock()


def _errno_of(exc: BaseException) -> int:
    code = getattr(exc, "error_code", -1)
    return code if isinstance(code, int) and code > 0 else 0


def _fail(what: str, exc: BaseException, hint: str | None = None) -> VerbsError:
    return VerbsError(f"{what}: {exc}", errno=_errno_of(exc), hint=hint)


def has_channel_fd() -> bool:
    """Whether ``CompChannel`` has ``.fd`` (rdma-core 57 and later)."""
    return hasattr(_cq.CompChannel, "fd")


def list_devices() -> list[str]:
    """Names of the RDMA devices; ``BackendUnavailable`` when there are none."""
    try:
        devices = _device.get_device_list()
    except _PyverbsError as exc:
        raise BackendUnavailable(
            f"no RDMA devices: {exc} (this kernel has no RDMA support or no RDMA driver is loaded)",
            hint=NO_DEVICE_HINT,
        ) from exc
    names = [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices]
    if not names:
        raise BackendUnavailable("no RDMA devices found", hint=NO_DEVICE_HINT)
    return names


class Context:
    """An opened device (``ibv_context``) and its async-event fd."""

    def __init__(self, name: str) -> None:
        with _open_lock:
            before = event_fds()
            try:
                self._ctx: Any = _device.Context(name=name)
            except _PyverbsError as exc:
                raise BackendUnavailable(f"cannot open RDMA device {name!r}: {exc}", hint=NO_DEVICE_HINT) from exc
            new = event_fds() - before
        self.name = name
        self.async_fd: int | None = new.pop() if len(new) == 1 else None
        if self.async_fd is not None:
            os.set_blocking(self.async_fd, False)

    def limits(self) -> DeviceLimits:
        try:
            a = self._ctx.query_device()
        except _PyverbsError as exc:
            raise _fail(f"query_device({self.name})", exc) from exc
        return DeviceLimits(
            max_qp_wr=int(a.max_qp_wr),
            max_sge=int(a.max_sge),
            max_cqe=int(a.max_cqe),
            max_qp_rd_atom=int(a.max_qp_rd_atom),
            max_qp_init_rd_atom=int(a.max_qp_init_rd_atom),
            max_mr_size=int(a.max_mr_size),
            phys_port_cnt=int(a.phys_port_cnt),
        )

    def port(self, port: int) -> PortFacts:
        try:
            a = self._ctx.query_port(port)
            table = self._ctx.query_gid_table(max(1, int(a.gid_tbl_len)) * max(1, self.limits().phys_port_cnt))
        except _PyverbsError as exc:
            raise _fail(f"query_port({self.name}, {port})", exc) from exc
        gids = tuple(
            GidEntry(int(g.gid_index), str(g.gid_str()), int(g.gid_type), int(g.ndev_ifindex))
            for g in table
            if int(g.port_num) == port
        )
        return PortFacts(
            port=port,
            state=int(a.state),
            active_mtu=int(a.active_mtu),
            max_mtu=int(a.max_mtu),
            link_layer=int(a.link_layer),
            lid=int(a.lid),
            gids=gids,
        )

    def get_async_event(self) -> int | None:
        """Take and acknowledge one async event (non-blocking fd): its type, or None if none was pending."""
        try:
            event = self._ctx.get_async_event()
        except _PyverbsError:
            return None
        kind = int(event.event_type)
        event.ack()
        return kind

    def close(self) -> None:
        try:
            self._ctx.close()
        except _PyverbsError as exc:
            raise _fail(f"close device {self.name}", exc) from exc


class PdHandle:
    def __init__(self, ctx: Context) -> None:
        try:
            self._pd: Any = _pd.PD(ctx._ctx)
        except _PyverbsError as exc:
            raise _fail("alloc_pd", exc) from exc

    def close(self) -> None:
        try:
            self._pd.close()
        except _PyverbsError as exc:
            raise _fail("dealloc_pd", exc) from exc


class MrHandle:
    """A registration of memory the caller owns (``ibv_reg_mr`` on its address)."""

    def __init__(self, pd: PdHandle, addr: int, length: int, access: int) -> None:
        try:
            self._mr: Any = _mr.MR(pd._pd, length, access, address=addr)
        except _PyverbsError as exc:
            raise _fail(f"ibv_reg_mr({length} bytes at {addr:#x})", exc) from exc
        self.lkey = int(self._mr.lkey)
        self.rkey = int(self._mr.rkey)

    def close(self) -> None:
        try:
            self._mr.close()
        except _PyverbsError as exc:
            raise _fail("ibv_dereg_mr", exc) from exc


class CqHandle:
    """A CQ with its own completion channel (None when pyverbs has no channel fd)."""

    def __init__(self, ctx: Context, depth: int) -> None:
        try:
            self._channel: Any = _cq.CompChannel(ctx._ctx) if has_channel_fd() else None
            self._cq: Any = _cq.CQ(ctx._ctx, depth, None, self._channel, 0)
        except _PyverbsError as exc:
            raise _fail(f"ibv_create_cq(depth={depth})", exc) from exc
        self.depth = int(self._cq.cqe)
        self.fd = -1
        if self._channel is not None:
            self.fd = int(self._channel.fd)
            os.set_blocking(self.fd, False)

    def req_notify(self) -> None:
        try:
            self._cq.req_notify()
        except _PyverbsError as exc:
            raise _fail("ibv_req_notify_cq", exc) from exc

    def get_events(self) -> int:
        """Consume and acknowledge every pending channel event; how many there were."""
        if self._channel is None:
            return 0
        taken = 0
        while True:
            try:
                self._channel.get_cq_event(self._cq)
            except _PyverbsError as exc:
                if _errno_of(exc) in (errno_mod.EAGAIN, errno_mod.EWOULDBLOCK):
                    break
                raise _fail("ibv_get_cq_event", exc) from exc
            self._cq.ack_events(1)
            taken += 1
        return taken

    def poll(self, max_entries: int) -> list[RawCompletion]:
        try:
            _, wcs = self._cq.poll(max_entries)
        except _PyverbsError as exc:
            raise _fail("ibv_poll_cq", exc) from exc
        return [
            RawCompletion(int(w.wr_id), int(w.status), int(w.vendor_err), int(w.qp_num), int(w.byte_len)) for w in wcs
        ]

    def close(self) -> None:
        try:
            self._cq.close()
            if self._channel is not None:
                self._channel.close()
        except _PyverbsError as exc:
            raise _fail("ibv_destroy_cq", exc) from exc


class QpHandle:
    """An RC queue pair with selective signaling (``sq_sig_all=0``), created in INIT."""

    def __init__(self, pd: PdHandle, cq: CqHandle, *, depth: int, max_sge: int, port: int, access: int) -> None:
        try:
            cap = _qp.QPCap(max_send_wr=depth, max_recv_wr=1, max_send_sge=max_sge, max_recv_sge=1)
            init = _qp.QPInitAttr(qp_type=_QPT_RC, scq=cq._cq, rcq=cq._cq, cap=cap, sq_sig_all=0)
            attr = _qp.QPAttr(port_num=port)
            attr.qp_access_flags = access
            attr.pkey_index = 0
            self._qp: Any = _qp.QP(pd._pd, init, attr)
        except _PyverbsError as exc:
            raise _fail(f"ibv_create_qp(depth={depth}, sge={max_sge})", exc) from exc
        self.qp_num = int(self._qp.qp_num)
        self.max_send_wr = int(init.max_send_wr)
        self.max_send_sge = int(init.max_send_sge)

    def connect(self, p: PathParams) -> None:
        try:
            attr = _qp.QPAttr(port_num=p.port, path_mtu=p.path_mtu)
            attr.dest_qp_num = p.dest_qp_num
            attr.rq_psn = p.rq_psn
            attr.max_dest_rd_atomic = p.max_dest_rd_atomic
            attr.min_rnr_timer = p.min_rnr_timer
            if p.is_global:
                gr = _addr.GlobalRoute(dgid=_addr.GID(p.dgid), sgid_index=p.sgid_index, hop_limit=64)
                attr.ah_attr = _addr.AHAttr(port_num=p.port, is_global=1, gr=gr, dlid=p.dlid)
            else:
                attr.ah_attr = _addr.AHAttr(port_num=p.port, is_global=0, dlid=p.dlid)
            self._qp.to_rtr(attr)
            attr.timeout = p.timeout
            attr.retry_cnt = p.retry_cnt
            attr.rnr_retry = p.rnr_retry
            attr.sq_psn = p.sq_psn
            attr.max_rd_atomic = p.max_rd_atomic
            self._qp.to_rts(attr)
        except _PyverbsError as exc:
            raise _fail(f"QP {self.qp_num}: INIT->RTR->RTS", exc) from exc

    def query_state(self) -> int:
        """``enum ibv_qp_state`` as the device reports it now."""
        try:
            attr, _ = self._qp.query(_QP_STATE_MASK)
        except _PyverbsError as exc:
            raise _fail(f"QP {self.qp_num}: ibv_query_qp", exc) from exc
        return int(attr.qp_state)

    def to_error(self) -> None:
        try:
            attr = _qp.QPAttr()
            attr.qp_state = _QPS_ERR
            self._qp.modify(attr, _QP_STATE_MASK)
        except _PyverbsError as exc:
            raise _fail(f"QP {self.qp_num}: modify to ERR", exc) from exc

    def post(self, wrs: Sequence[WorkRequest]) -> tuple[int, VerbsError | None]:
        """Post in order, one ``ibv_post_send`` each; (how many the hardware took, the error or None).

        One call per request, not a chain: after a chain fails part-way, pyverbs can
        report the bad request only by copying it over a caller's SendWR (its
        sg_list pointer too, which both objects would then free), and a provider
        may have queued part of the chain. One at a time, "taken" is exact.
        """
        for index, request in enumerate(wrs):
            send_wr = self._send_wr(request)
            try:
                self._qp.post_send(send_wr)
            except _PyverbsError as exc:
                return index, _fail(f"QP {self.qp_num}: ibv_post_send", exc)
            finally:
                send_wr.close()
        return len(wrs), None

    def post_fence(self, wr_id: int) -> VerbsError | None:
        """A signaled zero-length WRITE, for a pair in ERR: the device flushes it, in order."""
        sge = _wr.SGE(0, 0, 0)
        send_wr = _wr.SendWR(wr_id=wr_id, opcode=_WR_RDMA_WRITE, num_sge=1, sg=[sge], send_flags=_SEND_SIGNALED)
        sge.close()
        send_wr.set_wr_rdma(0, 0)
        try:
            self._qp.post_send(send_wr)
        except _PyverbsError as exc:
            return _fail(f"QP {self.qp_num}: posting the fence", exc)
        finally:
            send_wr.close()
        return None

    @staticmethod
    def _send_wr(w: WorkRequest) -> Any:
        sges = [_wr.SGE(s.addr, s.length, s.lkey) for s in w.sges]
        opcode = _WR_RDMA_READ if w.opcode is Opcode.RDMA_READ else _WR_RDMA_WRITE
        flags = _SEND_SIGNALED if w.signaled else 0
        send_wr = _wr.SendWR(wr_id=w.wr_id, opcode=opcode, num_sge=len(sges), sg=sges, send_flags=flags)
        send_wr.set_wr_rdma(w.rkey, w.remote_addr)
        for sge in sges:
            sge.close()
        return send_wr

    def close(self) -> None:
        try:
            self._qp.close()
        except _PyverbsError as exc:
            raise _fail(f"QP {self.qp_num}: ibv_destroy_qp", exc) from exc
