"""The device, its protection domain, memory registrations and completion queues, through pyverbs."""

from __future__ import annotations

import errno as errno_mod
import os
import threading
from typing import Any

from ....errors import BackendUnavailable
from ..facts import DeviceLimits, GidEntry, PortFacts
from ..values import NO_DEVICE_HINT, RawCompletion, event_fds
from . import lib

__all__ = ["Context", "CqHandle", "MrHandle", "PdHandle"]

_open_lock = threading.Lock()


class Context:
    """An opened device (``ibv_context``) and its async-event fd."""

    def __init__(self, name: str) -> None:
        with _open_lock:
            before = event_fds()
            try:
                self.raw: Any = lib.device.Context(name=name)
            except lib.PyverbsError as exc:
                raise BackendUnavailable(f"cannot open RDMA device {name!r}: {exc}", hint=NO_DEVICE_HINT) from exc
            new = event_fds() - before
        self.name = name
        self.async_fd: int | None = new.pop() if len(new) == 1 else None
        if self.async_fd is not None:
            os.set_blocking(self.async_fd, False)

    def limits(self) -> DeviceLimits:
        try:
            a = self.raw.query_device()
        except lib.PyverbsError as exc:
            raise lib.fail(f"query_device({self.name})", exc) from exc
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
            a = self.raw.query_port(port)
            table = self.raw.query_gid_table(max(1, int(a.gid_tbl_len)) * max(1, self.limits().phys_port_cnt))
        except lib.PyverbsError as exc:
            raise lib.fail(f"query_port({self.name}, {port})", exc) from exc
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
            event = self.raw.get_async_event()
        except lib.PyverbsError:
            return None
        kind = int(event.event_type)
        event.ack()
        return kind

    def close(self) -> None:
        lib.close(self.raw, f"close device {self.name}")


class PdHandle:
    def __init__(self, ctx: Context) -> None:
        try:
            self.raw: Any = lib.pd.PD(ctx.raw)
        except lib.PyverbsError as exc:
            raise lib.fail("alloc_pd", exc) from exc

    def close(self) -> None:
        lib.close(self.raw, "dealloc_pd")


class MrHandle:
    """A registration of memory the caller owns (``ibv_reg_mr`` on its address)."""

    def __init__(self, pd: PdHandle, addr: int, length: int, access: int) -> None:
        try:
            self._mr: Any = lib.mr.MR(pd.raw, length, access, address=addr)
        except lib.PyverbsError as exc:
            raise lib.fail(f"ibv_reg_mr({length} bytes at {addr:#x})", exc) from exc
        self.lkey = int(self._mr.lkey)
        self.rkey = int(self._mr.rkey)

    def close(self) -> None:
        lib.close(self._mr, "ibv_dereg_mr")


class CqHandle:
    """A CQ with its own completion channel (None when pyverbs has no channel fd)."""

    def __init__(self, ctx: Context, depth: int) -> None:
        try:
            self._channel: Any = lib.cq.CompChannel(ctx.raw) if lib.has_channel_fd() else None
            self.raw: Any = lib.cq.CQ(ctx.raw, depth, None, self._channel, 0)
        except lib.PyverbsError as exc:
            raise lib.fail(f"ibv_create_cq(depth={depth})", exc) from exc
        self.depth = int(self.raw.cqe)
        self.fd = -1
        if self._channel is not None:
            self.fd = int(self._channel.fd)
            os.set_blocking(self.fd, False)

    def req_notify(self) -> None:
        try:
            self.raw.req_notify()
        except lib.PyverbsError as exc:
            raise lib.fail("ibv_req_notify_cq", exc) from exc

    def get_events(self) -> int:
        """Consume and acknowledge every pending channel event; how many there were."""
        if self._channel is None:
            return 0
        taken = 0
        while True:
            try:
                self._channel.get_cq_event(self.raw)
            except lib.PyverbsError as exc:
                if lib.errno_of(exc) in (errno_mod.EAGAIN, errno_mod.EWOULDBLOCK):
                    break
                raise lib.fail("ibv_get_cq_event", exc) from exc
            self.raw.ack_events(1)
            taken += 1
        return taken

    def poll(self, max_entries: int) -> list[RawCompletion]:
        try:
            _, wcs = self.raw.poll(max_entries)
        except lib.PyverbsError as exc:
            raise lib.fail("ibv_poll_cq", exc) from exc
        return [
            RawCompletion(int(w.wr_id), int(w.status), int(w.vendor_err), int(w.qp_num), int(w.byte_len)) for w in wcs
        ]

    def close(self) -> None:
        try:
            self.raw.close()
            if self._channel is not None:
                self._channel.close()
        except lib.PyverbsError as exc:
            raise lib.fail("ibv_destroy_cq", exc) from exc
