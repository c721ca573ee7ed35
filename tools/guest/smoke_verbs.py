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
import itertools
import json
import os
import sys
import time
from collections.abc import Sequence

import pyverbs.libibverbs_enums as e
from pyverbs.cq import CQ, CompChannel
from pyverbs.device import Context, get_device_list
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.wr import SGE, RecvWR
from smoke_errors import error_paths
from verbs_kit import (
    ACCESS_REMOTE,
    CompletionDriver,
    Endpoint,
    connect,
    describe_device,
    make_qp,
    out,
    pattern,
    pick_gid,
    poll_until,
    post,
    rdma_wr,
)

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
