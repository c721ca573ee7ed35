#!/usr/bin/env python3
"""Soft-RoCE smoke test: real RC verbs through pyverbs, driven by asyncio.

Runs inside the guest (``tools/guest/run.py -- python3 tools/guest/smoke_verbs.py``).

One guest (``MORIIO_GUEST_COUNT=1``): two RC QPs on the same rxe device are
connected to each other; QP "a" issues RDMA WRITEs (single and multi-SGE),
READs and a WRITE_WITH_IMM into QP "b"'s memory, then the error paths are
exercised (a wrong rkey, posting on a QP in the error state, SQ overflow,
recovery through RESET).

Two guests: role ``a`` serves its memory region, role ``b`` connects over TCP
(``MORIIO_GUEST_PEER_IP``), exchanges QP numbers, GIDs and keys, and writes and
reads a's memory across the emulated wire; ``a`` verifies the bytes.

Completions of the initiator's CQ are driven by the event loop:
``loop.add_reader(channel.fd)`` -> get_cq_event / ack_events / req_notify /
poll until empty. Prints a summary; exits nonzero on any mismatch.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import itertools
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyverbs.libibverbs_enums as e
from pyverbs.addr import GID, AHAttr, GlobalRoute
from pyverbs.cq import CQ, CompChannel
from pyverbs.device import Context, get_device_list
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.pyverbs_error import PyverbsRDMAError
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE, RecvWR, SendWR

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


# --------------------------------------------------------------------------- one guest


async def loopback(args: argparse.Namespace) -> int:
    loop = asyncio.get_running_loop()
    ctx = Context(name=args.device)
    info = describe_device(ctx)
    gid_index, gid = pick_gid(ctx, info["gid_tbl_len"])
    out(f"using gid index {gid_index} {gid}")
    pd = PD(ctx)
    size, count, depth = args.size, args.count, args.depth
    src = MR(pd, size * 2, e.IBV_ACCESS_LOCAL_WRITE)
    sink = MR(pd, size * 2, e.IBV_ACCESS_LOCAL_WRITE)
    remote = MR(pd, size * 2, ACCESS_REMOTE)
    channel = CompChannel(ctx)
    cq_a = CQ(ctx, depth * 2, None, channel, 0)
    cq_b = CQ(ctx, depth * 2)  # target side: polled directly, no channel
    qp_a = make_qp(pd, cq_a, depth, 2)
    qp_b = make_qp(pd, cq_b, depth, 2)
    out(f"cq_a.cqe={cq_a.cqe} (asked {depth * 2})")
    qa, _ = qp_a.query(e.IBV_QP_CAP)
    out(
        f"qp a cap after create: max_send_wr={qa.cap.max_send_wr} "
        f"max_send_sge={qa.cap.max_send_sge} max_inline_data={qa.cap.max_inline_data}"
    )
    ep_a = Endpoint(qp_a.qp_num, 100, gid, gid_index, src.rkey, src.buf, size)
    ep_b = Endpoint(qp_b.qp_num, 200, gid, gid_index, remote.rkey, remote.buf, size * 2)
    mtu = info["active_mtu"]
    out(f"qp a states {connect(qp_a, ep_a, ep_b, mtu)}")
    out(f"qp b states {connect(qp_b, ep_b, ep_a, mtu)}")
    out(f"state enum: {[(s.name, int(s)) for s in e.ibv_qp_state]}")
    driver = CompletionDriver(loop, channel, cq_a)
    failures: int = 0

    # 1. WRITEs, alternating one SGE and two SGEs (two halves of src).
    t0 = time.perf_counter()
    for i in range(count):
        data = pattern(i, size)
        src.write(data, size)
        half = size // 2
        sges = (
            [(src.buf, size, src.lkey)]
            if i % 2 == 0
            else [(src.buf, half, src.lkey), (src.buf + half, size - half, src.lkey)]
        )
        fut = driver.expect(i)
        post(qp_a, rdma_wr(i, e.IBV_WR_RDMA_WRITE, sges, remote.rkey, remote.buf))
        wc = await asyncio.wait_for(fut, 10)
        if wc.status != e.IBV_WC_SUCCESS or remote.read(size, 0) != data:
            failures += 1
            out(f"FAIL write {i}: status {wc.status}")
    dt = time.perf_counter() - t0
    out(
        f"{count} RDMA WRITEs of {size} B verified: {dt / count * 1e3:.2f} ms each, "
        f"{count * size / dt / 1e6:.1f} MB/s (emulated)"
    )
    wc_sample = wc

    # 2. pipelined WRITEs: batches of `depth` WRs linked with next_wr and posted
    # with ONE post_send; only the last WR of a batch is signaled. By the verbs
    # contract, unsignaled WRs keep their SQ slots until a later signaled WR's
    # completion is polled, so waiting for each batch's signaled WR frees the queue.
    remote_data = pattern(99, size)
    src.write(remote_data, size)
    t0 = time.perf_counter()
    for start in range(0, count, depth):
        batch = range(start, min(start + depth, count))
        fut = driver.expect(10_000 + batch[-1])
        chain = [
            rdma_wr(
                10_000 + i,
                e.IBV_WR_RDMA_WRITE,
                [(src.buf, size, src.lkey)],
                remote.rkey,
                remote.buf + size,
                signaled=i == batch[-1],
            )
            for i in batch
        ]
        for wr, nxt in itertools.pairwise(chain):
            wr.next_wr = nxt  # a C pointer into nxt: keep every SendWR alive until posted
        try:
            qp_a.post_send(chain[0])
        finally:
            for wr in chain:
                wr.close()
        wc = await asyncio.wait_for(fut, 30)
        failures += wc.status != e.IBV_WC_SUCCESS
    dt = time.perf_counter() - t0
    ok = remote.read(size, size) == remote_data
    failures += not ok
    out(
        f"{count} pipelined WRITEs (chains of {depth} in one post_send, one signaled): {dt * 1e3:.0f} ms "
        f"total, {count * size / dt / 1e6:.1f} MB/s, verified={ok}"
    )

    # 3. READs back from the remote MR into sink.
    t0 = time.perf_counter()
    for i in range(count):
        fut = driver.expect(20_000 + i)
        post(
            qp_a, rdma_wr(20_000 + i, e.IBV_WR_RDMA_READ, [(sink.buf, size, sink.lkey)], remote.rkey, remote.buf + size)
        )
        wc = await asyncio.wait_for(fut, 10)
        if wc.status != e.IBV_WC_SUCCESS or sink.read(size, 0) != remote_data:
            failures += 1
            out(f"FAIL read {i}: status {wc.status}")
    dt = time.perf_counter() - t0
    out(f"{count} RDMA READs of {size} B verified: {dt / count * 1e3:.2f} ms each")

    # 4. WRITE_WITH_IMM: consumes a RECV at the target, which sees the imm_data.
    recv_sge = SGE(sink.buf + size, 64, sink.lkey)
    qp_b.post_recv(RecvWR(wr_id=777, num_sge=1, sg=[recv_sge]))
    fut = driver.expect(30_000)
    post(
        qp_a,
        rdma_wr(
            30_000, e.IBV_WR_RDMA_WRITE_WITH_IMM, [(src.buf, 256, src.lkey)], remote.rkey, remote.buf, imm=0x12345678
        ),
    )
    wc = await asyncio.wait_for(fut, 10)
    target = await poll_until(cq_b, 10)
    out(
        f"write_with_imm: initiator wc status={wc.status} opcode={wc.opcode}; target wc "
        f"wr_id={target.wr_id} status={target.status} opcode={target.opcode} "
        f"byte_len={target.byte_len} imm_data={target.imm_data:#x} "
        f"wc_flags={target.wc_flags:#x} qp_num={target.qp_num} src_qp={target.src_qp}"
    )
    failures += target.status != e.IBV_WC_SUCCESS

    out(
        f"sample write wc: wr_id={wc_sample.wr_id} status={wc_sample.status} "
        f"opcode={wc_sample.opcode} byte_len={wc_sample.byte_len} qp_num={wc_sample.qp_num} "
        f"vendor_err={wc_sample.vendor_err}"
    )
    failures += await error_paths(driver, qp_a, qp_b, ep_a, ep_b, src, remote, mtu, depth)

    out(f"cq events {driver.events}, EAGAIN wakeups {driver.spurious}, wcs {driver.polled}")
    driver.close()
    for obj in (qp_a, qp_b, cq_a, cq_b, channel, src, sink, remote, pd, ctx):
        obj.close()
    return failures


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


async def error_paths(
    driver: CompletionDriver,
    qp_a: QP,
    qp_b: QP,
    ep_a: Endpoint,
    ep_b: Endpoint,
    src: MR,
    remote: MR,
    mtu: int,
    depth: int,
) -> int:
    failures: int = 0

    def reconnect_both() -> None:
        for qp in (qp_a, qp_b):
            reset(qp)
        connect(qp_a, ep_a, ep_b, mtu)
        connect(qp_b, ep_b, ep_a, mtu)

    async def one(
        wr_id: int, sges: list[tuple[int, int, int]], rkey: int, raddr: int, timeout: float = 30
    ) -> tuple[Any, float]:
        fut = driver.expect(wr_id)
        t0 = time.perf_counter()
        post(qp_a, rdma_wr(wr_id, e.IBV_WR_RDMA_WRITE, sges, rkey, raddr))
        wc = await asyncio.wait_for(fut, timeout)
        return wc, time.perf_counter() - t0

    good = [(src.buf, 64, src.lkey)]
    # a) wrong rkey: NAK "remote access error"; initiator AND responder QPs go to ERR.
    wc, dt = await one(40_000, good, (remote.rkey + 0x100) & 0xFFFFFFFF, remote.buf)
    out(
        f"wrong rkey: wc status={wc_name(wc.status)} vendor_err={wc.vendor_err} "
        f"opcode={wc.opcode} after {dt * 1e3:.1f} ms; states a,b: {state_names(qp_a, qp_b)}"
    )
    failures += wc.status != e.IBV_WC_REM_ACCESS_ERR
    # b) posting on a QP in ERR is accepted and completes as flushed.
    try:
        wc, dt = await one(40_001, good, remote.rkey, remote.buf)
        out(f"post on ERR qp: accepted, wc status={wc_name(wc.status)}")
    except PyverbsRDMAError as exc:
        out(f"post on ERR qp raised error_code={exc.error_code}: {exc}")
    # c) recovery needs both sides: RESET -> INIT -> RTR -> RTS on each.
    reconnect_both()
    wc, dt = await one(40_002, good, remote.rkey, remote.buf)
    out(f"after RESET + reconnect of both: wc status={wc_name(wc.status)}")
    failures += wc.status != e.IBV_WC_SUCCESS
    # d) valid rkey but past the end of the remote MR.
    wc, dt = await one(40_003, good, remote.rkey, remote.buf + remote.length - 32)
    out(f"write past the remote MR end: wc status={wc_name(wc.status)}; states a,b: {state_names(qp_a, qp_b)}")
    reconnect_both()
    # e) bad lkey on the local SGE.
    wc, dt = await one(40_004, [(src.buf, 64, (src.lkey + 0x100) & 0xFFFFFFFF)], remote.rkey, remote.buf)
    out(f"bad lkey: wc status={wc_name(wc.status)}; states a,b: {state_names(qp_a, qp_b)}")
    reconnect_both()
    # f) dead peer with retry_cnt=7: b in RESET drops every packet and rxe keeps
    # retrying forever, so nothing completes: fill the SQ until post_send refuses,
    # then move a to ERR, which flushes every WR with a completion of its own,
    # signaled or not (RESET would drop them all without any completion).
    reset(qp_a)
    connect(qp_a, ep_a, ep_b, mtu, retry_cnt=7)
    reset(qp_b)
    driver.unmatched.clear()
    fut = driver.expect(40_005)
    post(qp_a, rdma_wr(40_005, e.IBV_WR_RDMA_WRITE, good, remote.rkey, remote.buf))
    posted = 1
    try:
        for i in range(depth * 4):
            post(qp_a, rdma_wr(50_000 + i, e.IBV_WR_RDMA_WRITE, good, remote.rkey, remote.buf, signaled=False))
            posted += 1
        out(f"SQ overflow: {posted} posts all accepted")
    except PyverbsRDMAError as exc:
        out(
            f"SQ overflow: post #{posted + 1} raised error_code={exc.error_code} "
            f"({errno.errorcode.get(exc.error_code, '?')}): {exc}"
        )
    try:
        wc = await asyncio.wait_for(asyncio.shield(fut), 5)
        out(f"dead peer, retry_cnt=7: wc status={wc_name(wc.status)} within 5 s")
    except TimeoutError:
        attr = QPAttr()
        attr.qp_state = e.IBV_QPS_ERR
        qp_a.modify(attr, e.IBV_QP_STATE)
        wc = await asyncio.wait_for(fut, 30)
        await asyncio.sleep(0.5)
        flushed = sorted({wc_name(w.status) for w in driver.unmatched})
        out(
            f"dead peer, retry_cnt=7: no completion in 5 s (rxe retries forever); after "
            f"modify to ERR: wc status={wc_name(wc.status)}, and {len(driver.unmatched)} "
            f"completions for the {posted - 1} unsignaled WRs: {flushed}"
        )
    reconnect_both()
    # g) dead peer with timeout=10 (4 ms) and retry_cnt=2: the first WR ends with
    # RETRY_EXC_ERR, the ones behind it are flushed, in order.
    reset(qp_a)
    connect(qp_a, ep_a, ep_b, mtu, timeout=10, retry_cnt=2)
    reset(qp_b)
    driver.unmatched.clear()
    futs = [driver.expect(60_000 + i) for i in range(8)]
    t0 = time.perf_counter()
    for i in range(8):
        post(qp_a, rdma_wr(60_000 + i, e.IBV_WR_RDMA_WRITE, good, remote.rkey, remote.buf))
    wcs = await asyncio.wait_for(asyncio.gather(*futs), 60)
    dt = time.perf_counter() - t0
    out(
        f"dead peer, timeout=10 retry_cnt=2: 8 signaled WRs ended in {dt:.2f} s with "
        f"{[wc_name(w.status) for w in wcs[:2]]} + {len(wcs) - 2} more"
    )
    failures += wcs[0].status != e.IBV_WC_RETRY_EXC_ERR
    reconnect_both()
    wc, dt = await one(40_007, good, remote.rkey, remote.buf)
    out(f"final write after recovery: wc status={wc_name(wc.status)}")
    failures += wc.status != e.IBV_WC_SUCCESS
    return failures


def reset(qp: QP) -> None:
    attr = QPAttr()
    attr.qp_state = e.IBV_QPS_RESET
    qp.modify(attr, e.IBV_QP_STATE)


# --------------------------------------------------------------------------- two guests


async def pair(args: argparse.Namespace) -> int:
    role = os.environ.get("MORIIO_GUEST_ROLE", "a")
    peer = os.environ["MORIIO_GUEST_PEER_IP"]
    loop = asyncio.get_running_loop()
    ctx = Context(name=args.device)
    info = describe_device(ctx)
    gid_index, gid = pick_gid(ctx, info["gid_tbl_len"])
    pd = PD(ctx)
    size, count = args.size, args.count
    mr = MR(pd, size * 2, ACCESS_REMOTE)
    channel = CompChannel(ctx)
    cq = CQ(ctx, args.depth * 2, None, channel, 0)
    qp = make_qp(pd, cq, args.depth, 1)
    mine = Endpoint(qp.qp_num, 300 if role == "a" else 400, gid, gid_index, mr.rkey, mr.buf, size * 2)
    if role == "a":
        reader, writer = await accept_once(args.port)
    else:
        reader, writer = await connect_retry(peer, args.port, 120)
    writer.write((json.dumps(mine.__dict__) + "\n").encode())
    await writer.drain()
    theirs = Endpoint(**json.loads(await reader.readline()))
    out(f"role {role}: local qpn {mine.qpn} gid {gid}; peer qpn {theirs.qpn} gid {theirs.gid}")
    out(f"qp states {connect(qp, mine, theirs, info['active_mtu'])}")
    writer.write(b"rts\n")
    await writer.drain()
    await reader.readline()  # both RTS before any traffic
    failures: int = 0
    if role == "b":
        driver = CompletionDriver(loop, channel, cq)
        t0 = time.perf_counter()
        for i in range(count):
            data = pattern(i, size)
            mr.write(data, size)
            fut = driver.expect(i)
            post(
                qp,
                rdma_wr(i, e.IBV_WR_RDMA_WRITE, [(mr.buf, size, mr.lkey)], theirs.rkey, theirs.addr + (i % 2) * size),
            )
            wc = await asyncio.wait_for(fut, 30)
            failures += wc.status != e.IBV_WC_SUCCESS
        dt = time.perf_counter() - t0
        out(
            f"{count} cross-guest WRITEs of {size} B: {dt / count * 1e3:.2f} ms each, "
            f"{count * size / dt / 1e6:.1f} MB/s (emulated)"
        )
        fut = driver.expect(99_999)
        post(
            qp,
            rdma_wr(
                99_999,
                e.IBV_WR_RDMA_READ,
                [(mr.buf + size, size, mr.lkey)],
                theirs.rkey,
                theirs.addr + ((count - 1) % 2) * size,
            ),
        )
        wc = await asyncio.wait_for(fut, 30)
        read_ok = wc.status == e.IBV_WC_SUCCESS and mr.read(size, size) == pattern(count - 1, size)
        failures += not read_ok
        out(f"cross-guest READ back verified={read_ok}")
        driver.close()
        writer.write(json.dumps({"last": count - 1, "failures": failures}).encode() + b"\n")
        await writer.drain()
        verdict = json.loads(await reader.readline())
        failures += verdict["failures"]
    else:
        report = json.loads(await reader.readline())
        last = report["last"]
        got = mr.read(size, (last % 2) * size)
        ok = got == pattern(last, size)
        out(f"role a: bytes written by b verified={ok}")
        failures += (not ok) + report["failures"]
        writer.write(json.dumps({"failures": int(not ok)}).encode() + b"\n")
        await writer.drain()
    writer.close()
    for obj in (qp, cq, channel, mr, pd, ctx):
        obj.close()
    return failures


async def accept_once(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    got: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.get_running_loop().create_future()

    def on_client(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        if not got.done():
            got.set_result((r, w))

    server = await asyncio.start_server(on_client, "0.0.0.0", port, reuse_address=True)
    async with server:
        return await asyncio.wait_for(got, 120)


async def connect_retry(host: str, port: int, timeout: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await asyncio.open_connection(host, port)
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=os.environ.get("MORIIO_GUEST_DEVICE", "rxe0"))
    parser.add_argument("--count", type=int, default=64)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--port", type=int, default=18515)
    parser.add_argument("--mode", choices=("auto", "loop", "pair"), default="auto")
    args = parser.parse_args(argv)
    names = [d.name.decode() for d in get_device_list()]
    out(f"devices {names}")
    mode = args.mode
    if mode == "auto":
        mode = "pair" if os.environ.get("MORIIO_GUEST_COUNT") == "2" else "loop"
    t0 = time.perf_counter()
    failures = asyncio.run(loopback(args) if mode == "loop" else pair(args))
    verdict = "PASS" if failures == 0 else f"FAIL ({failures} failures)"
    out(f"{verdict} mode={mode} in {time.perf_counter() - t0:.1f}s")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
