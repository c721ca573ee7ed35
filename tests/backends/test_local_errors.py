"""Checks at the initiator: a bad local SGE completes LOC_PROT_ERR in order, flushes the rest, moves nothing."""

from __future__ import annotations

import time

import numpy as np
import pytest

from moriio_async.backends.base import QpState
from moriio_async.errors import InvalidArgument
from moriio_async.status import Access, Opcode, WcStatus
from moriio_async.work import Sge, WorkRequest

from .harness import Pair, PairFactory, digest, random_bytes, statuses, wr_ids

pytestmark = pytest.mark.timeout(60)

SIZE = 4096
MiB = 1 << 20
W, R = Opcode.RDMA_WRITE, Opcode.RDMA_READ

KINDS = {
    "bad-lkey-write": W,
    "bad-lkey-read": R,
    "sge-past-end-write": W,
    "sge-past-end-read": R,
    "sge-before-start-write": W,
    "second-sge-bad-write": W,
    "read-into-region-without-local-write": R,
    "deregistered-local-write": W,
}


def bad_request(pair: Pair, kind: str, op: Opcode) -> WorkRequest:
    mr = pair.a.mr
    good = Sge(mr.addr + SIZE, SIZE, mr.lkey)
    if kind.startswith("bad-lkey"):
        sge = Sge(good.addr, SIZE, (mr.lkey ^ 0x5A5A5A5A) or 1)
    elif kind.startswith("sge-past-end"):
        sge = Sge(mr.addr + mr.length - SIZE + 1, SIZE, mr.lkey)
    elif kind.startswith("sge-before-start"):
        sge = Sge(mr.addr - 1, SIZE, mr.lkey)
    elif kind == "second-sge-bad-write":
        return WorkRequest(1, op, (good, Sge(mr.addr + mr.length, 1, mr.lkey)), pair.b.mr.addr + SIZE, pair.b.mr.rkey)
    elif kind == "read-into-region-without-local-write":
        ro = pair.a.register(np.zeros(SIZE, np.uint8), Access.REMOTE_READ)
        sge = Sge(ro.addr, SIZE, ro.lkey)
    else:
        gone = pair.a.register(np.zeros(SIZE, np.uint8), Access.all())
        pair.a.deregister(gone)
        sge = Sge(gone.addr, SIZE, gone.lkey)
    return WorkRequest(1, op, (sge,), pair.b.mr.addr + SIZE, pair.b.mr.rkey)


@pytest.mark.parametrize("kind", list(KINDS))
def test_bad_local_sge_fails_in_order_and_moves_nothing(pairs: PairFactory, kind: str) -> None:
    op = KINDS[kind]
    pair = pairs()
    pair.a.buf[:] = random_bytes(len(pair.a.buf), 41)
    expected_b = pair.b.buf.copy()
    expected_b[:SIZE] = pair.a.buf[:SIZE]  # only the first request executes
    expected_a = pair.a.buf.copy()
    wrs = [
        pair.write(0, 0, SIZE, 0, signaled=False),
        bad_request(pair, kind, op),
        pair.write(2, 2 * SIZE, SIZE, 2 * SIZE),
        pair.read(3, 3 * SIZE, SIZE, 3 * SIZE, signaled=False),
    ]

    wcs = pair.run(wrs, expect=3)

    assert wr_ids(wcs) == [1, 2, 3]
    assert statuses(wcs) == [WcStatus.LOC_PROT_ERR, WcStatus.WR_FLUSH_ERR, WcStatus.WR_FLUSH_ERR]
    assert pair.a.qp.state == QpState.ERR
    assert digest(pair.b.buf) == digest(expected_b), "target bytes changed"
    assert digest(pair.a.buf) == digest(expected_a), "initiator bytes changed"


def test_a_write_bad_at_both_ends_fails_on_its_local_side_first(pairs: PairFactory) -> None:
    """A WRITE whose local SGE and remote range are both bad is a local protection error: the
    initiator reads its payload before the target could refuse it, as a verbs NIC does."""
    pair = pairs()
    mr = pair.a.mr
    bad_local = Sge(mr.addr, SIZE, (mr.lkey ^ 0x5A5A5A5A) or 1)
    bad_remote = pair.b.mr.addr + pair.b.mr.length  # one past the end of the target's region
    expected_b = pair.b.buf.copy()
    wrs = [WorkRequest(0, W, (bad_local,), bad_remote, pair.b.mr.rkey), pair.write(1, SIZE, SIZE, SIZE)]

    wcs = pair.run(wrs, expect=2)

    assert statuses(wcs) == [WcStatus.LOC_PROT_ERR, WcStatus.WR_FLUSH_ERR]
    assert digest(pair.b.buf) == digest(expected_b), "target bytes changed"


def test_remote_write_access_needs_local_write(pairs: PairFactory) -> None:
    """As ibv_reg_mr: REMOTE_WRITE without LOCAL_WRITE is refused."""
    pair = pairs()
    with pytest.raises(InvalidArgument):
        pair.a.register(np.zeros(SIZE, np.uint8), Access.REMOTE_WRITE)


def test_deregistering_a_local_region_under_in_flight_reads(pairs: PairFactory) -> None:
    """READ responses never land in a local region after its deregistration returned."""
    size, chunk = 8 << 20, 128 << 10
    pair = pairs(MiB, size, sq_depth=64)
    n = size // chunk
    local = np.zeros(size, np.uint8)
    mr = pair.a.register(local, Access.all())
    pair.a.qp.post_send([pair.read(i, i * chunk, chunk, i * chunk, local_mr=mr) for i in range(n)])
    first = pair.waiter.wait(1)

    pair.a.deregister(mr)
    snapshot = local.copy()

    wcs = first + pair.waiter.wait(n - 1)
    time.sleep(0.1)
    assert digest(local) == digest(snapshot), "a READ response landed after deregistration returned"
    assert wr_ids(wcs) == list(range(n))
    sts = statuses(wcs)
    ok = sts.count(WcStatus.SUCCESS)
    assert sts[:ok] == [WcStatus.SUCCESS] * ok
    if ok < n:
        assert sts[ok] is not WcStatus.WR_FLUSH_ERR, sts  # the request that met the dead region fails itself
        assert sts[ok + 1 :] == [WcStatus.WR_FLUSH_ERR] * (n - ok - 1), sts
    for i in range(ok):
        assert np.array_equal(snapshot[i * chunk : (i + 1) * chunk], pair.b.buf[i * chunk : (i + 1) * chunk])
