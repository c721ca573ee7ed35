#!/usr/bin/env python3
"""Helpers the guest's pyverbs tools share: the device, an asyncio completion driver, RC QP setup.

``smoke_verbs.py`` and ``smoke_errors.py`` use them inside the Soft-RoCE guest
(``tools/guest/run.py -- python3 tools/guest/smoke_verbs.py``); nothing here
runs by itself.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyverbs.libibverbs_enums as e
from pyverbs.addr import GID, AHAttr, GlobalRoute
from pyverbs.cq import CQ, CompChannel
from pyverbs.device import Context
from pyverbs.pd import PD
from pyverbs.pyverbs_error import PyverbsRDMAError
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE, SendWR

PORT = 1
ACCESS_REMOTE = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
IPV4_MAPPED = "0000:0000:0000:0000:0000:ffff:"


def out(msg: str) -> None:
    print(f"smoke: {msg}", flush=True)


# --------------------------------------------------------------------------- device


def describe_device(ctx: Context) -> dict[str, Any]:
    attr = ctx.query_device()
    port = ctx.query_port(PORT)
    info = {
        "max_qp": attr.max_qp,
        "max_qp_wr": attr.max_qp_wr,
        "max_sge": attr.max_sge,
        "max_sge_rd": attr.max_sge_rd,
        "max_cq": attr.max_cq,
        "max_cqe": attr.max_cqe,
        "max_mr": attr.max_mr,
        "max_mr_size": attr.max_mr_size,
        "max_pd": attr.max_pd,
        "max_qp_rd_atom": attr.max_qp_rd_atom,
        "max_qp_init_rd_atom": attr.max_qp_init_rd_atom,
        "max_res_rd_atom": attr.max_res_rd_atom,
        "max_srq_wr": attr.max_srq_wr,
        "atomic_caps": int(attr.atomic_caps),
        "page_size_cap": attr.page_size_cap,
        "port_state": int(port.state),
        "active_mtu": int(port.active_mtu),
        "max_mtu": int(port.max_mtu),
        "gid_tbl_len": port.gid_tbl_len,
        "link_layer": int(port.link_layer),
        "max_msg_sz": port.max_msg_sz,
        "num_comp_vectors": ctx.num_comp_vectors,
    }
    out("device " + json.dumps(info, sort_keys=True))
    return info


def pick_gid(ctx: Context, gid_tbl_len: int) -> tuple[int, str]:
    """Index and text of the RoCE v2 GID that carries the port's IPv4 address."""
    found: list[tuple[int, str, int]] = []
    try:
        for entry in ctx.query_gid_table(gid_tbl_len):
            if entry.port_num == PORT:
                found.append((entry.gid_index, entry.gid_str(), int(entry.gid_type)))
        source = "query_gid_table"
    except PyverbsRDMAError:
        source = "query_gid+query_gid_type"
        for index in range(gid_tbl_len):
            gid = str(ctx.query_gid(PORT, index))
            if gid != "0000:0000:0000:0000:0000:0000:0000:0000":
                found.append((index, gid, int(ctx.query_gid_type(PORT, index))))
    for index, gid, gtype in found:
        out(f"gid[{index}] {gid} type={gtype} ({source})")
    for index, gid, gtype in found:
        if gtype == e.IBV_GID_TYPE_ROCE_V2 and gid.startswith(IPV4_MAPPED):
            return index, gid
    raise SystemExit("smoke: FAIL no RoCE v2 IPv4-mapped GID on the port")


# --------------------------------------------------------------------------- asyncio CQ driver


class CompletionDriver:
    """Resolves one future per signaled wr_id from a CQ bound to a CompChannel."""

    def __init__(self, loop: asyncio.AbstractEventLoop, channel: CompChannel, cq: CQ) -> None:
        self.loop = loop
        self.channel = channel
        self.cq = cq
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.events = 0
        self.spurious = 0
        self.polled = 0
        self.unmatched: list[Any] = []  # completions nobody waited for
        os.set_blocking(channel.fd, False)
        cq.req_notify()  # arm before the first post, or the first event is lost
        loop.add_reader(channel.fd, self._on_readable)

    def close(self) -> None:
        self.loop.remove_reader(self.channel.fd)

    def expect(self, wr_id: int) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = self.loop.create_future()
        self.pending[wr_id] = fut
        return fut

    def _on_readable(self) -> None:
        try:
            self.channel.get_cq_event(self.cq)
            self.cq.ack_events(1)
            self.events += 1
        except PyverbsRDMAError as exc:
            if exc.error_code != errno.EAGAIN:
                raise
            self.spurious += 1  # readable but already consumed: normal
        # Re-arm first, then drain: a completion landing between the last poll
        # and the re-arm would otherwise never raise an event.
        self.cq.req_notify()
        while True:
            n, wcs = self.cq.poll(32)
            for wc in wcs:
                self.polled += 1
                fut = self.pending.pop(wc.wr_id, None)
                if fut is None:
                    self.unmatched.append(wc)
                elif not fut.done():
                    fut.set_result(wc)
            if n < 32:
                break


# --------------------------------------------------------------------------- QP helpers


@dataclass
class Endpoint:
    """What the other side needs to reach a QP and its memory."""

    qpn: int
    psn: int
    gid: str
    gid_index: int
    rkey: int
    addr: int
    length: int


def make_qp(pd: PD, cq: CQ, depth: int, max_sge: int) -> QP:
    cap = QPCap(max_send_wr=depth, max_recv_wr=depth, max_send_sge=max_sge, max_recv_sge=1)
    # sq_sig_all=0: only WRs posted with IBV_SEND_SIGNALED produce a completion.
    init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0)
    return QP(pd, init)


def connect(qp: QP, local: Endpoint, remote: Endpoint, mtu: int, *, timeout: int = 14, retry_cnt: int = 6) -> list[str]:
    """RESET -> INIT -> RTR -> RTS towards remote; returns the states seen."""
    attr = QPAttr(port_num=PORT, path_mtu=mtu)
    attr.qp_access_flags = ACCESS_REMOTE
    attr.pkey_index = 0
    states = [e.ibv_qp_state(real_state(qp)).name]
    qp.to_init(attr)
    states.append(e.ibv_qp_state(real_state(qp)).name)
    # RoCE has no LIDs: the address is a global route to the peer's GID.
    gr = GlobalRoute(dgid=GID(remote.gid), sgid_index=local.gid_index, hop_limit=64)
    attr.ah_attr = AHAttr(is_global=1, port_num=PORT, gr=gr)
    attr.dest_qp_num = remote.qpn
    attr.rq_psn = remote.psn
    attr.max_dest_rd_atomic = 4
    attr.min_rnr_timer = 12
    qp.to_rtr(attr)
    states.append(e.ibv_qp_state(real_state(qp)).name)
    attr.sq_psn = local.psn
    attr.timeout = timeout  # 4.096 us * 2**timeout per try (14: 67 ms)
    # retry_cnt 7 is NOT "7 tries" on rxe: it retries forever (see PYVERBS_NOTES.md).
    attr.retry_cnt = retry_cnt
    attr.rnr_retry = 7
    attr.max_rd_atomic = 4
    qp.to_rts(attr)
    states.append(e.ibv_qp_state(real_state(qp)).name)
    return states


def rdma_wr(
    wr_id: int,
    opcode: int,
    sges: Sequence[tuple[int, int, int]],
    rkey: int,
    raddr: int,
    signaled: bool = True,
    imm: int = 0,
) -> SendWR:
    sg = [SGE(addr, length, lkey) for addr, length, lkey in sges]
    wr = SendWR(
        wr_id=wr_id,
        opcode=opcode,
        num_sge=len(sg),
        sg=sg,
        imm_data=imm,
        send_flags=e.IBV_SEND_SIGNALED if signaled else 0,
    )
    wr.set_wr_rdma(rkey, raddr)
    return wr


def post(qp: QP, wr: SendWR) -> None:
    try:
        qp.post_send(wr)
    finally:
        wr.close()  # SendWR frees its SGE array only in close() (no __dealloc__)


def pattern(seed: int, size: int) -> bytes:
    block = bytes((seed * 31 + i * 7) & 0xFF for i in range(256))
    return (block * (size // 256 + 1))[:size]


async def poll_until(cq: CQ, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        n, wcs = cq.poll(1)
        if n:
            return wcs[0]
        await asyncio.sleep(0.001)
    raise TimeoutError("no completion on the polled CQ")


def real_state(qp: QP) -> int:
    """The QP state as the kernel knows it (qp.qp_state is a userspace cache)."""
    attr, _ = qp.query(e.IBV_QP_STATE)
    return int(attr.qp_state)


def state_names(*qps: QP) -> str:
    return " ".join(f"{e.ibv_qp_state(real_state(q)).name}(cached {int(q.qp_state)})" for q in qps)


def wc_name(status: int) -> str:
    return f"{status} {e.ibv_wc_status(status).name}"


def reset(qp: QP) -> None:
    attr = QPAttr()
    attr.qp_state = e.IBV_QPS_RESET
    qp.modify(attr, e.IBV_QP_STATE)
