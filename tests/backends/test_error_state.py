"""The error state: to_error flushes everything in order; posting to an ERR pair is accepted and flushed."""

from __future__ import annotations

import time

import pytest

from moriio_async.backends.base import QpState
from moriio_async.status import WcStatus

from .harness import PairFactory, digest, random_bytes, statuses, wr_ids

pytestmark = pytest.mark.timeout(60)

CHUNK = 256 << 10


def test_to_error_flushes_everything_outstanding_in_order(pairs: PairFactory) -> None:
    pair = pairs(16 << 20, 16 << 20, sq_depth=64)
    n = 64
    pair.a.buf[:] = random_bytes(len(pair.a.buf), 51)
    wrs = [
        pair.write(i, i * CHUNK, CHUNK, i * CHUNK) if i % 3 else pair.read(i, i * CHUNK, CHUNK, i * CHUNK)
        for i in range(n)
    ]
    pair.a.qp.post_send(wrs)
    pair.a.qp.to_error()
    assert pair.a.qp.state == QpState.ERR

    wcs = pair.waiter.wait(n)

    assert wr_ids(wcs) == list(range(n))
    sts = statuses(wcs)
    ok = sts.count(WcStatus.SUCCESS)
    assert sts == [WcStatus.SUCCESS] * ok + [WcStatus.WR_FLUSH_ERR] * (n - ok), sts
    assert all(wc.byte_len == CHUNK for wc in wcs[:ok])
    pair.waiter.expect_none(0.2)


def test_posting_to_an_err_pair_is_accepted_and_flushed(pairs: PairFactory) -> None:
    pair = pairs()
    pair.a.qp.to_error()
    pair.a.qp.to_error()  # idempotent
    pair.waiter.expect_none(0.1)
    target = digest(pair.b.buf)
    local = digest(pair.a.buf)

    pair.a.qp.post_send(
        [pair.write(1, 0, 4096, 0), pair.read(2, 0, 4096, 0, signaled=False), pair.write(3, 0, 4096, 0)]
    )
    wcs = pair.waiter.wait(3)

    assert wr_ids(wcs) == [1, 2, 3]
    assert statuses(wcs) == [WcStatus.WR_FLUSH_ERR] * 3
    time.sleep(0.05)
    assert digest(pair.b.buf) == target and digest(pair.a.buf) == local


def test_error_on_one_pair_leaves_another_pair_alone(pairs: PairFactory) -> None:
    first, second = pairs(), pairs()
    first.a.qp.to_error()
    second.a.buf[:4096] = 9
    wcs = second.run([second.write(1, 0, 4096, 0)])
    assert statuses(wcs) == [WcStatus.SUCCESS]
    assert (second.b.buf[:4096] == 9).all()
    assert second.a.qp.state == QpState.RTS
