#!/usr/bin/env python3
"""The smoke test's error paths on one rxe device: what real RC verbs do on each failure.

A wrong rkey, posting on a QP in the error state, recovery through RESET, a
write past the remote MR, a bad lkey, a dead peer with infinite and with
bounded retries (SQ overflow, flushes). Run by ``smoke_verbs.py`` (one guest)
after its data-path checks; each line it prints is what the verbs backend's
error mapping was written against (``PYVERBS_NOTES.md``).
"""

from __future__ import annotations

import asyncio
import errno
import time
from typing import Any

import pyverbs.libibverbs_enums as e
from pyverbs.mr import MR
from pyverbs.pyverbs_error import PyverbsRDMAError
from pyverbs.qp import QP, QPAttr
from verbs_kit import CompletionDriver, Endpoint, connect, out, post, rdma_wr, reset, state_names, wc_name


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
