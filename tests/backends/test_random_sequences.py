"""Random request streams checked against a model of RC semantics.

Each stream mixes READs and WRITEs of random sizes and scatter lists,
signaled and not, posted in random batches as slots allow, with at most one
bad request somewhere. The model: every request before the bad one succeeds
in order; the bad one fails with its own status; every later one flushes.
From that follow the exact completion list (no completion for an unsignaled
success, one for everything else, in posting order) and every byte of both
buffers. Local areas are disjoint (WRITEs read from SRC, READs land in DST)
so no request depends on an unfenced earlier READ, which RC would not order.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest

from moriio_async.backends.base import MemoryRegion
from moriio_async.status import Access, Opcode, WcStatus
from moriio_async.work import Sge, WorkCompletion, WorkRequest

from .harness import Pair, PairFactory, digest, random_bytes

pytestmark = pytest.mark.timeout(60)

SIZE = 1 << 20
SRC, DST = 0, SIZE // 2  # local areas: WRITE sources, READ destinations
BAD_KINDS = ["none", "rkey", "remote-bounds", "lkey", "local-bounds"]


@dataclass
class Planned:
    wr: WorkRequest
    status: WcStatus  # what the request does if it is reached before any failure


def random_request(
    pair: Pair, rng: random.Random, wr_id: int, signaled: bool, bad: str, second: MemoryRegion
) -> Planned:
    """One request; its SGEs lie in A's main region or in ``second`` (so one request, and one
    batch, may span two local regions)."""
    op = rng.choice([Opcode.RDMA_WRITE, Opcode.RDMA_READ])
    nsge = rng.randint(1, min(4, pair.a.qp.max_sge))
    lengths = [rng.randint(1, 4096) for _ in range(nsge)]
    area = SRC if op is Opcode.RDMA_WRITE else DST
    sges = [pair.a.sge(area + rng.randrange(0, SIZE // 2 - n), n, rng.choice([pair.a.mr, second])) for n in lengths]
    remote = pair.b.mr.addr + rng.randrange(0, SIZE - sum(lengths))
    rkey, status = pair.b.mr.rkey, WcStatus.SUCCESS
    if bad == "rkey":
        rkey, status = (rkey ^ 0x00FF00FF) or 1, WcStatus.REM_ACCESS_ERR
    elif bad == "remote-bounds":
        remote, status = pair.b.mr.addr + SIZE - sum(lengths) + 1, WcStatus.REM_ACCESS_ERR
    elif bad == "lkey":
        sges[0] = Sge(sges[0].addr, sges[0].length, (pair.a.mr.lkey ^ 0x00FF00FF) or 1)
        status = WcStatus.LOC_PROT_ERR
    elif bad == "local-bounds":
        sges[-1] = Sge(pair.a.mr.addr + SIZE - sges[-1].length + 1, sges[-1].length, pair.a.mr.lkey)
        status = WcStatus.LOC_PROT_ERR
    return Planned(WorkRequest(wr_id, op, tuple(sges), remote, rkey, signaled), status)


def apply(planned: list[Planned], local: dict[int, tuple[np.ndarray, int]], target: np.ndarray, base_b: int) -> None:
    """The model's bytes: each successful request in posting order (``local``: lkey -> buffer, address)."""
    for p in planned:
        if p.status is not WcStatus.SUCCESS:
            return
        pos = p.wr.remote_addr - base_b
        for sge in p.wr.sges:
            buf, base = local[sge.lkey]
            off = sge.addr - base
            if p.wr.opcode is Opcode.RDMA_WRITE:
                target[pos : pos + sge.length] = buf[off : off + sge.length]
            else:
                buf[off : off + sge.length] = target[pos : pos + sge.length]
            pos += sge.length


@pytest.mark.parametrize("seed", range(12))
def test_random_stream_matches_the_rc_model(pairs: PairFactory, seed: int) -> None:
    rng = random.Random(seed)
    pair = pairs(SIZE, SIZE, sq_depth=32)
    pair.a.buf[:] = random_bytes(SIZE, seed + 100)
    other = random_bytes(SIZE, seed + 200)
    second = pair.a.register(other, Access.all())
    depth = pair.a.qp.max_send_wr
    total = 400
    bad_at = rng.randrange(total // 4, total) if seed % 3 else None
    bad_kind = BAD_KINDS[1 + seed % 4] if bad_at is not None else "none"
    expect_local, expect_other, expect_target = pair.a.buf.copy(), other.copy(), pair.b.buf.copy()

    planned: list[Planned] = []
    got: list[WorkCompletion] = []
    covered = 0  # requests whose slot came back (a polled completion covers everything before it)
    since_signal = 0
    while len(planned) < total:
        room = depth - (len(planned) - covered)
        batch: list[Planned] = []
        for _ in range(min(room, rng.randint(1, 8), total - len(planned))):
            i = len(planned) + len(batch)
            since_signal += 1
            signaled = rng.random() < 0.3 or since_signal >= depth // 2 or i == total - 1
            since_signal = 0 if signaled else since_signal
            batch.append(random_request(pair, rng, i, signaled, bad_kind if i == bad_at else "none", second))
        if batch:
            pair.a.qp.post_send([p.wr for p in batch])
            planned += batch
        completion_due = any(
            p.wr.signaled or (bad_at is not None and i >= bad_at) for i, p in enumerate(planned[covered:], covered)
        )
        if completion_due and (not batch or rng.random() < 0.5):
            for wc in pair.waiter.wait_some():
                got.append(wc)
                covered = wc.wr_id + 1

    failed_at = next((i for i, p in enumerate(planned) if p.status is not WcStatus.SUCCESS), None)
    expected: list[tuple[int, WcStatus]] = []
    for i, p in enumerate(planned):
        if failed_at is None or i < failed_at:
            if p.wr.signaled:
                expected.append((i, WcStatus.SUCCESS))
        else:
            expected.append((i, p.status if i == failed_at else WcStatus.WR_FLUSH_ERR))
    got += pair.waiter.wait(len(expected) - len(got))
    assert [(wc.wr_id, wc.status) for wc in got] == expected
    pair.waiter.expect_none(0.1)

    model = {pair.a.mr.lkey: (expect_local, pair.a.mr.addr), second.lkey: (expect_other, second.addr)}
    apply(planned, model, expect_target, pair.b.mr.addr)
    assert digest(pair.b.buf) == digest(expect_target), "target bytes differ from the model"
    assert digest(pair.a.buf) == digest(expect_local), "initiator bytes differ from the model"
    assert digest(other) == digest(expect_other), "initiator bytes (second region) differ from the model"
