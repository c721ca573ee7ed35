#!/usr/bin/env python3
"""How to post many RDMA WRITEs per call through pyverbs on rxe: the ways measured, and one rxe bug shown.

Runs inside the guest, on pyverbs directly (not moriio_async):

    python3 tools/guest/run.py -- python3 tools/guest/post_methods.py [--n 256] [--rounds 8]

Two RC queue pairs on rxe0, connected to each other, the initiator an extended QP (``QPEx``, send
ops RDMA WRITE and READ). For each method, ``rounds`` posts of ``n`` 4 KiB WRITEs (the last one
signaled; the CQ polled until it completes). Two times per request: *building* (wall time from
the first call to the last one before the doorbell: the Python and libibverbs work a method
costs) and the *whole post* (building plus the doorbell). rxe runs the requester inside the
doorbell's system call, so the whole post also carries rxe's own work, the same for every method.
Process CPU accounting is no help here: under emulation it is sampled at the tick.

* ``one``: one ``SendWR`` and one ``post_send`` per request (what the backend did before batches);
* ``chain``: fresh ``SendWR`` objects linked with ``next_wr``, one ``post_send``;
* ``chain-pool``: the same with ``SendWR``/``SGE`` objects made once and refilled (each pooled
  ``SendWR``'s ``sg_list`` pointed at its own reusable ``SGE``: pointer aliasing that pyverbs 59
  survives only because its ``__dealloc`` is misspelled, so nothing frees twice);
* ``qpex``: ``wr_start``, per request ``wr_id``/``wr_flags``, ``wr_rdma_write``, one reused ``SGE``
  refilled and ``wr_set_sge``, then one ``wr_complete`` (what the backend does);
* ``qpex-list``: the same with ``wr_set_sge_list(1, [sge])``;
* ``4-sge chain`` / ``4-sge qpex-list``: four equal 1 KiB scatter entries per request.

Both the pooled chain and ``qpex`` set a field only when it changed (flags, length, lkey).

Then the rxe provider's ``wr_set_sge_list`` with scatter entries of different lengths: rdma-core
59's ``providers/rxe/rxe.c`` sums ``num_sge`` times the *first* entry's length (its loop never
advances ``sg_list``). One WRITE of [1024, 3072] bytes and one of [3072, 1024], each posted once
with ``wr_set_sge_list`` and once with ``post_send``: the completion and how many target bytes
changed are printed (the right answer is 4096 for both).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import pyverbs.libibverbs_enums as e
from pyverbs.addr import GID, AHAttr, GlobalRoute
from pyverbs.cq import CQ
from pyverbs.device import Context
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.qp import QPAttr, QPCap, QPEx, QPInitAttrEx
from pyverbs.wr import SGE, SendWR

PORT = 1
ACCESS = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
BLOCK = 4096


def gid_index(ctx: Context) -> tuple[int, str]:
    for entry in ctx.query_gid_table(ctx.query_port(PORT).gid_tbl_len):
        gid = entry.gid_str()
        if entry.port_num == PORT and entry.gid_type == e.IBV_GID_TYPE_ROCE_V2 and ":ffff:" in gid:
            return int(entry.gid_index), str(gid)
    raise SystemExit("post_methods: no RoCE v2 IPv4 GID")


def make_qp(ctx: Context, pd: PD, cq: CQ, depth: int) -> QPEx:
    cap = QPCap(max_send_wr=depth, max_recv_wr=1, max_send_sge=16, max_recv_sge=1)
    init = QPInitAttrEx(
        qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0, pd=pd,
        comp_mask=e.IBV_QP_INIT_ATTR_PD | e.IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
        send_ops_flags=e.IBV_QP_EX_WITH_RDMA_WRITE | e.IBV_QP_EX_WITH_RDMA_READ,
    )  # fmt: skip
    attr = QPAttr(port_num=PORT)
    attr.qp_access_flags = ACCESS
    attr.pkey_index = 0
    return QPEx(ctx, init, attr)


def connect(qp: QPEx, peer: QPEx, gid: str, index: int) -> None:
    attr = QPAttr(port_num=PORT, path_mtu=e.IBV_MTU_1024)
    attr.dest_qp_num = peer.qp_num
    attr.rq_psn = 0
    attr.max_dest_rd_atomic = 4
    attr.min_rnr_timer = 12
    attr.ah_attr = AHAttr(port_num=PORT, is_global=1, gr=GlobalRoute(dgid=GID(gid), sgid_index=index, hop_limit=64))
    qp.to_rtr(attr)
    attr.timeout, attr.retry_cnt, attr.rnr_retry, attr.sq_psn, attr.max_rd_atomic = 12, 6, 7, 0, 4
    qp.to_rts(attr)


class Rig:
    def __init__(self, depth: int) -> None:
        self.ctx = Context(name=os.environ.get("MORIIO_GUEST_DEVICE", "rxe0"))
        self.pd = PD(self.ctx)
        self.cq = CQ(self.ctx, 4 * depth)
        self.src = MR(self.pd, 4 << 20, ACCESS)
        self.dst = MR(self.pd, 4 << 20, ACCESS)
        self.a, self.b = make_qp(self.ctx, self.pd, self.cq, depth), make_qp(self.ctx, self.pd, self.cq, depth)
        index, gid = gid_index(self.ctx)
        connect(self.a, self.b, gid, index)
        connect(self.b, self.a, gid, index)
        self.depth = depth

    def wait(self, wr_id: int, timeout: float = 60) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            _, wcs = self.cq.poll(16)
            for wc in wcs:
                if wc.status != e.IBV_WC_SUCCESS or wc.wr_id == wr_id:
                    return wc
        raise SystemExit(f"post_methods: wr_id {wr_id} did not complete")


Request = tuple[int, int, int, int, int, int]  # wr_id, flags, remote addr, rkey, local addr, lkey


def requests(rig: Rig, n: int, first: int) -> list[Request]:
    flags = [0] * (n - 1) + [e.IBV_SEND_SIGNALED]
    return [
        (first + i, flags[i], rig.dst.buf + i * BLOCK, rig.dst.rkey, rig.src.buf + i * BLOCK, rig.src.lkey)
        for i in range(n)
    ]


def post_one(rig: Rig, reqs: list[Request]) -> float:
    """Returns 0: building and posting alternate, so there is no separate building time."""
    for wr_id, flags, raddr, rkey, laddr, lkey in reqs:
        sge = SGE(laddr, BLOCK, lkey)
        wr = SendWR(wr_id=wr_id, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[sge], send_flags=flags)
        sge.close()
        wr.set_wr_rdma(rkey, raddr)
        rig.a.post_send(wr)
        wr.close()
    return 0.0


def post_chain(rig: Rig, reqs: list[Request], sges: int = 1) -> float:
    t0 = time.perf_counter()
    part = BLOCK // sges
    wrs = []
    for wr_id, flags, raddr, rkey, laddr, lkey in reqs:
        sg = [SGE(laddr + k * part, part, lkey) for k in range(sges)]
        wr = SendWR(wr_id=wr_id, opcode=e.IBV_WR_RDMA_WRITE, num_sge=sges, sg=sg, send_flags=flags)
        for s in sg:
            s.close()
        wr.set_wr_rdma(rkey, raddr)
        if wrs:
            wrs[-1].next_wr = wr
        wrs.append(wr)
    built = time.perf_counter() - t0
    rig.a.post_send(wrs[0])
    for wr in wrs:
        wr.close()
    return built


class Pool:
    """SendWRs linked once (i -> i+1); a post of n fills the last n and posts from there."""

    def __init__(self, depth: int) -> None:
        self.sges = [SGE(0, 0, 0) for _ in range(depth)]
        self.wrs = []
        for sge in self.sges:
            wr = SendWR(opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[sge], send_flags=0)
            wr.close()  # its own copy of the entry; point it at the reusable SGE instead
            wr.sg_list = sge
            if self.wrs:
                self.wrs[-1].next_wr = wr
            self.wrs.append(wr)

    def post(self, rig: Rig, reqs: list[Request]) -> float:
        t0 = time.perf_counter()
        k = len(self.wrs) - len(reqs)
        for wr, sge, (wr_id, flags, raddr, rkey, laddr, lkey) in zip(self.wrs[k:], self.sges[k:], reqs, strict=True):
            wr.wr_id = wr_id
            if wr.send_flags != flags:  # what the backend would do: set only what changed
                wr.send_flags = flags
            wr.set_wr_rdma(rkey, raddr)
            sge.addr = laddr
            if sge.length != BLOCK:
                sge.length = BLOCK
            if sge.lkey != lkey:
                sge.lkey = lkey
        built = time.perf_counter() - t0
        rig.a.post_send(self.wrs[k])
        return built


def post_qpex(rig: Rig, reqs: list[Request], sge: SGE) -> float:
    """As the backend does it (moriio_async/backends/verbs/_pyverbs/qp.py): unchanged fields are not set again."""
    t0 = time.perf_counter()
    qp = rig.a
    write, set_sge = qp.wr_rdma_write, qp.wr_set_sge
    flags = length = key = -1
    qp.wr_start()
    for wr_id, f, raddr, rkey, laddr, lkey in reqs:
        qp.wr_id = wr_id
        if f != flags:
            qp.wr_flags = flags = f
        write(rkey, raddr)
        sge.addr = laddr
        if length != BLOCK:
            sge.length = length = BLOCK
        if lkey != key:
            sge.lkey = key = lkey
        set_sge(sge)
    built = time.perf_counter() - t0
    qp.wr_complete()
    return built


def post_qpex_list(rig: Rig, reqs: list[Request], sges: int = 1) -> float:
    t0 = time.perf_counter()
    qp = rig.a
    part = BLOCK // sges
    sg = [SGE(0, part, 0) for _ in range(sges)]
    qp.wr_start()
    for wr_id, flags, raddr, rkey, laddr, lkey in reqs:
        qp.wr_id = wr_id
        qp.wr_flags = flags
        qp.wr_rdma_write(rkey, raddr)
        for k, s in enumerate(sg):
            s.addr = laddr + k * part
            s.lkey = lkey
        qp.wr_set_sge_list(sges, sg)
    built = time.perf_counter() - t0
    qp.wr_complete()
    for s in sg:
        s.close()
    return built


def measure(rig: Rig, name: str, post: Callable[[list[Request]], float], n: int, rounds: int) -> dict[str, float]:
    build = wall = 0.0
    first = 1
    post(requests(rig, n, first))  # warm-up
    rig.wait(first + n - 1)
    first += n
    for _ in range(rounds):
        reqs = requests(rig, n, first)
        w0 = time.perf_counter()
        build += post(reqs)
        wall += time.perf_counter() - w0
        wc = rig.wait(first + n - 1)
        if wc.status != e.IBV_WC_SUCCESS:
            raise SystemExit(f"post_methods: {name}: status {wc.status}")
        first += n
    total = n * rounds
    row = {"build_us_per_wr": 1e6 * build / total, "post_us_per_wr": 1e6 * wall / total}
    print(f"post_methods: {name:<18} building {row['build_us_per_wr']:8.1f} us/WR   whole post "
          f"{row['post_us_per_wr']:8.1f} us/WR  ({rounds} x {n})", flush=True)  # fmt: skip
    return row


def sge_list_bug(rig: Rig) -> None:
    """WRITE [a, b] bytes gathered from two places, via wr_set_sge_list and via post_send."""
    for lengths in ((1024, 3072), (3072, 1024)):
        for via in ("wr_set_sge_list", "post_send"):
            rig.dst.write(b"\0" * 16384, 16384, 0)
            rig.src.write(b"\xab" * 16384, 16384, 0)
            sg = [SGE(rig.src.buf, lengths[0], rig.src.lkey), SGE(rig.src.buf + 8192, lengths[1], rig.src.lkey)]
            wr_id = 900_000 + lengths[0]
            if via == "post_send":
                wr = SendWR(wr_id=wr_id, opcode=e.IBV_WR_RDMA_WRITE, num_sge=2, sg=sg, send_flags=e.IBV_SEND_SIGNALED)
                wr.set_wr_rdma(rig.dst.rkey, rig.dst.buf)
                rig.a.post_send(wr)
                wr.close()
            else:
                rig.a.wr_start()
                rig.a.wr_id = wr_id
                rig.a.wr_flags = e.IBV_SEND_SIGNALED
                rig.a.wr_rdma_write(rig.dst.rkey, rig.dst.buf)
                rig.a.wr_set_sge_list(2, sg)
                rig.a.wr_complete()
            for s in sg:
                s.close()
            wc = rig.wait(wr_id, timeout=10)
            written = sum(1 for b in rig.dst.read(16384, 0) if b)
            print(f"post_methods: sge lengths {list(lengths)} via {via:<15} -> status {wc.status} "
                  f"byte_len {wc.byte_len}; target bytes written {written} (expected {sum(lengths)})",
                  flush=True)  # fmt: skip
            if wc.status != e.IBV_WC_SUCCESS:
                return  # the pair is in error now: nothing more to learn on it


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=256, help="requests per post")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args(argv)
    rig = Rig(args.n)
    pool = Pool(args.n)
    sge = SGE(0, 0, 0)
    methods: list[tuple[str, Callable[[list[Request]], float]]] = [
        ("one", lambda r: post_one(rig, r)),
        ("chain", lambda r: post_chain(rig, r)),
        ("chain-pool", lambda r: pool.post(rig, r)),
        ("qpex", lambda r: post_qpex(rig, r, sge)),
        ("qpex-list", lambda r: post_qpex_list(rig, r)),
        ("4-sge chain", lambda r: post_chain(rig, r, 4)),
        ("4-sge qpex-list", lambda r: post_qpex_list(rig, r, 4)),
    ]
    for _ in range(2):  # twice, interleaved, so a burst of load on the host shows as a disagreement
        for name, post in methods:
            measure(rig, name, post, args.n, args.rounds)
    sge_list_bug(rig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
