"""A batch of a few blocks given as plain ints (checked and planned on the ints) ends exactly as the same
batch given as unsigned arrays (which always take the array path): the same bytes land, the same status,
the same error for a bad block, for sizes that cross ``SMALL``, and a failure is reported the same way."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np
import pytest

from moriio_async import InvalidArgument, Session, Transfer, TransferFailed
from moriio_async.core.plan import SMALL
from moriio_async.status import StatusCode, WcStatus

from .conftest import Pair

pytestmark = pytest.mark.timeout(120)

Blocks = tuple[list[int], list[int], list[int]]


def layout(n: int, seed: int) -> Blocks:
    """``n`` blocks on 256-byte slots, some contiguous on one side, both or neither (so some merge)."""
    rng = np.random.default_rng(seed)
    lo = (rng.permutation(64)[:n] * 256).tolist()
    ro = (rng.permutation(64)[:n] * 256).tolist()
    if n > 2:
        lo[1], ro[1] = lo[0] + 256, ro[0] + 256  # block 1 continues block 0 on both sides
        ro[2] = ro[1] + 256  # block 2 continues it on the remote side only
        lo[2] = lo[2] if lo[2] not in lo[:2] else 60 * 256
    sz = [256] * n
    return lo, ro, sz


def unsigned(blocks: Blocks) -> tuple[np.ndarray, ...]:
    return tuple(np.asarray(v, dtype=np.uint32) for v in blocks)


async def run(call: Callable[..., Transfer], blocks: tuple[object, ...]) -> tuple[StatusCode, WcStatus | None]:
    t = call(*blocks)
    with contextlib.suppress(TransferFailed):
        await t
    err = t.error()
    return t.code, err.wc_status if err is not None else None


def fill(pair: Pair) -> None:
    pair.buf_a[:] = np.arange(len(pair.buf_a), dtype=np.uint64).astype(np.uint8)
    pair.buf_b[:] = 0


@pytest.mark.parametrize("n", [1, 2, 3, SMALL - 1, SMALL, SMALL + 1, SMALL + 3])
@pytest.mark.parametrize("op", ["write", "read"])
async def test_a_few_blocks_as_ints_end_as_the_same_blocks_as_arrays(pair: Pair, n: int, op: str) -> None:
    blocks = layout(n, seed=n)
    s: Session = pair.session
    call = s.batch_write if op == "write" else s.batch_read
    landed = []
    for given in (blocks, unsigned(blocks)):
        fill(pair)
        assert await run(call, given) == (StatusCode.SUCCESS, None)
        landed.append((pair.buf_a.copy(), pair.buf_b.copy()))
    assert all(np.array_equal(x, y) for x, y in zip(landed[0], landed[1], strict=True))
    moved = landed[0][1] if op == "write" else landed[0][0]
    assert moved.any()  # something moved (the bytes of buf_a are not all zero)


@pytest.mark.parametrize("n", [1, SMALL, SMALL + 1])
async def test_a_bad_block_is_refused_with_the_same_message(pair: Pair, n: int) -> None:
    lo, ro, sz = layout(n, seed=3)
    ro[-1] = len(pair.buf_b) - 8  # the last block runs past the remote region
    messages = []
    for given in ((lo, ro, sz), unsigned((lo, ro, sz))):
        with pytest.raises(InvalidArgument) as info:
            pair.session.batch_write(*given)
        messages.append(str(info.value))
    assert messages[0] == messages[1] and f"block {n - 1}: remote range" in messages[0]


@pytest.mark.parametrize("n", [2, SMALL])
async def test_a_failed_few_ends_as_a_failed_batch(pair: Pair, n: int) -> None:
    """The target's region goes away: both forms end ERR_RDMA_OP with REM_ACCESS_ERR (the session's
    pair is replaced in between, so later transfers run again)."""
    blocks = layout(n, seed=5)
    pair.b.deregister_memory(pair.desc_b)
    got = [await run(pair.session.batch_write, given) for given in (blocks, unsigned(blocks))]
    assert got == [(StatusCode.ERR_RDMA_OP, WcStatus.REM_ACCESS_ERR)] * 2
