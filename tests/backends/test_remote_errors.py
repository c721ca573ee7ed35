"""Checks at the target: a bad request completes REM_ACCESS_ERR, flushes the rest, and changes no byte."""

from __future__ import annotations

import time

import numpy as np
import pytest

from moriio_async.backends.base import QpState
from moriio_async.status import Access, Opcode, WcStatus
from moriio_async.work import WorkRequest

from .harness import Pair, PairFactory, digest, random_bytes, statuses, wr_ids

pytestmark = pytest.mark.timeout(60)

SIZE = 4096
W, R = Opcode.RDMA_WRITE, Opcode.RDMA_READ
NO_REMOTE_WRITE = Access.LOCAL_WRITE | Access.REMOTE_READ
NO_REMOTE_READ = Access.LOCAL_WRITE | Access.REMOTE_WRITE

# kind: (target access, the bad request's opcode, the good requests' opcode)
KINDS = {
    "wrong-rkey-write": (Access.all(), W, W),
    "wrong-rkey-read": (Access.all(), R, R),
    "past-end-write": (Access.all(), W, W),
    "past-end-read": (Access.all(), R, R),
    "before-start-write": (Access.all(), W, W),
    "no-remote-write": (NO_REMOTE_WRITE, W, R),
    "no-remote-read": (NO_REMOTE_READ, R, W),
    "deregistered-write": (Access.all(), W, W),
    "deregistered-read": (Access.all(), R, R),
}


def bad_request(pair: Pair, kind: str, op: Opcode) -> WorkRequest:
    mr = pair.b.mr
    local = [(SIZE, SIZE)]
    if kind.startswith("wrong-rkey"):
        return pair.wr(1, op, local, 0, rkey=(mr.rkey ^ 0x5A5A5A5A) or 1)
    if kind.startswith("past-end"):
        return pair.wr(1, op, local, mr.length - SIZE + 1)  # one byte past the end
    if kind.startswith("before-start"):
        return pair.wr(1, op, local, 0, remote_addr=mr.addr - 1)
    if kind.startswith("deregistered"):
        spare = np.zeros(SIZE, np.uint8)
        gone = pair.b.register(spare, Access.all())
        pair.b.deregister(gone)
        return pair.wr(1, op, local, 0, rkey=gone.rkey, remote_addr=gone.addr)
    return pair.wr(1, op, local, 0)  # the access flags are what is wrong


@pytest.mark.parametrize("kind", list(KINDS))
def test_bad_remote_request_fails_flushes_and_touches_nothing(pairs: PairFactory, kind: str) -> None:
    access, bad_op, good_op = KINDS[kind]
    pair = pairs(access_b=access)
    pair.a.buf[:] = random_bytes(len(pair.a.buf), 21)
    expected_a, expected_b = pair.a.buf.copy(), pair.b.buf.copy()
    if good_op is W:  # only the first good request executes
        expected_b[:SIZE] = pair.a.buf[:SIZE]
    else:
        expected_a[:SIZE] = pair.b.buf[:SIZE]
    wrs = [
        pair.wr(0, good_op, [(0, SIZE)], 0),
        bad_request(pair, kind, bad_op),
        pair.wr(2, good_op, [(2 * SIZE, SIZE)], 2 * SIZE),
        pair.wr(3, good_op, [(3 * SIZE, SIZE)], 3 * SIZE, signaled=False),  # failures complete regardless
    ]

    wcs = pair.run(wrs, expect=4)

    assert wr_ids(wcs) == [0, 1, 2, 3]
    assert statuses(wcs) == [
        WcStatus.SUCCESS,
        WcStatus.REM_ACCESS_ERR,
        WcStatus.WR_FLUSH_ERR,
        WcStatus.WR_FLUSH_ERR,
    ]
    assert wcs[1].opcode is bad_op
    assert pair.a.qp.state == QpState.ERR
    time.sleep(0.05)  # nothing may still be on its way
    assert digest(pair.b.buf) == digest(expected_b), "target bytes changed"
    assert digest(pair.a.buf) == digest(expected_a), "initiator bytes changed"


def test_deregistration_racing_writes_never_writes_after_it_returns(pairs: PairFactory) -> None:
    size, chunk = 8 << 20, 128 << 10
    pair = pairs(size, size, sq_depth=64)
    n = size // chunk
    pair.a.buf[:] = random_bytes(size, 31)
    pair.a.qp.post_send([pair.write(i, i * chunk, chunk, i * chunk) for i in range(n)])
    first = pair.waiter.wait(1)

    pair.b.deregister(pair.b.mr)  # while later WRITEs are on the wire or being received
    snapshot = pair.b.buf.copy()

    wcs = first + pair.waiter.wait(n - 1)
    time.sleep(0.1)
    assert digest(pair.b.buf) == digest(snapshot), "a byte was written after deregistration returned"
    assert wr_ids(wcs) == list(range(n))
    sts = statuses(wcs)
    ok = sts.count(WcStatus.SUCCESS)
    assert sts[:ok] == [WcStatus.SUCCESS] * ok
    if ok < n:
        assert sts[ok] is WcStatus.REM_ACCESS_ERR, f"request {ok}: {sts[ok].name}, vendor {wcs[ok].vendor_err:#x}"
        assert sts[ok + 1 :] == [WcStatus.WR_FLUSH_ERR] * (n - ok - 1), sts
    for i in range(ok):  # what completed had landed before deregistration returned
        assert np.array_equal(snapshot[i * chunk : (i + 1) * chunk], pair.a.buf[i * chunk : (i + 1) * chunk])


# (offset from the region's start, length, allowed): the exact edges of a region of EDGE bytes.
EDGE = 1024
EDGES = {
    "starts-at-start": (0, 64, True),
    "ends-at-end": (EDGE - 64, 64, True),
    "whole-region": (0, EDGE, True),
    "one-byte-before-start": (-1, 64, False),
    "ends-one-byte-past-end": (EDGE - 63, 64, False),
    "starts-at-end": (EDGE, 1, False),
    "whole-region-shifted-one-byte": (1, EDGE, False),
}


@pytest.mark.parametrize("op", [W, R], ids=["write", "read"])
@pytest.mark.parametrize("edge", list(EDGES))
def test_requests_at_the_exact_edges_of_a_region(pairs: PairFactory, edge: str, op: Opcode) -> None:
    """A request inside a region up to its last byte moves exactly its bytes; one that reaches a single
    byte before or past it completes REM_ACCESS_ERR and changes no byte. The region sits inside a
    larger buffer, so the bytes around it are canaries a wrong check would touch."""
    offset, length, allowed = EDGES[edge]
    pair = pairs()
    arena = random_bytes(3 * EDGE, 5)
    region = pair.b.register(arena[EDGE : 2 * EDGE], Access.all())
    pair.a.buf[:length] = random_bytes(length, 6)
    before_arena, before_a = arena.copy(), pair.a.buf.copy()

    (wc,) = pair.run([pair.wr(0, op, [(0, length)], 0, rkey=region.rkey, remote_addr=region.addr + offset)])

    if not allowed:
        assert wc.status is WcStatus.REM_ACCESS_ERR
        time.sleep(0.05)  # nothing may still be on its way
        assert digest(arena) == digest(before_arena), "a rejected request changed the target"
        assert digest(pair.a.buf) == digest(before_a), "a rejected read changed the initiator"
        return
    assert wc.status is WcStatus.SUCCESS
    lo = EDGE + offset
    expected = before_arena.copy()
    if op is W:
        expected[lo : lo + length] = pair.a.buf[:length]
        assert digest(arena) == digest(expected)
    else:
        assert digest(arena) == digest(before_arena), "a read changed the target"
        assert np.array_equal(pair.a.buf[:length], arena[lo : lo + length])
        assert digest(pair.a.buf[length:]) == digest(before_a[length:])
