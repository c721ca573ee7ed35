"""Bytes move intact: READ and WRITE of many sizes with scatter lists, many requests in flight, in order."""

from __future__ import annotations

import numpy as np
import pytest

from moriio_async.status import Opcode, WcStatus

from .harness import PairFactory, digest, random_bytes, statuses, wr_ids

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20

# (total length, SGEs): from one byte to 16 MiB, one to sixteen SGEs.
CASES = [(1, 1), (7, 3), (4096, 1), (4096, 16), (65537, 3), (MiB + 3, 16), (16 * MiB, 1), (16 * MiB, 7)]


def scatter_list(total: int, nsge: int, seed: int) -> list[tuple[int, int]]:
    """``nsge`` pieces of ``total`` bytes at unaligned, shuffled, non-adjacent local offsets."""
    rng = np.random.default_rng(seed)
    cuts = sorted((rng.choice(total - 1, nsge - 1, replace=False) + 1).tolist()) if nsge > 1 else []
    lengths = np.diff([0, *cuts, total]).tolist()
    order = rng.permutation(nsge).tolist()  # where each piece sits in the local buffer
    offsets = [0] * nsge
    pos = 5
    for i in order:
        offsets[i] = pos
        pos += lengths[i] + int(rng.integers(1, 64))
    return list(zip(offsets, lengths, strict=True))


@pytest.mark.parametrize(("total", "nsge"), CASES, ids=[f"{t}B-{n}sge" for t, n in CASES])
def test_write_lands_byte_identical(pairs: PairFactory, total: int, nsge: int) -> None:
    pair = pairs(total + 64 * nsge + 64, total + 64)
    nsge = min(nsge, pair.a.qp.max_sge)
    pair.a.buf[:] = random_bytes(len(pair.a.buf), 11)
    sges = scatter_list(total, nsge, seed=total)
    remote = 13 if total + 13 <= len(pair.b.buf) else 0
    expected = pair.b.buf.copy()
    expected[remote : remote + total] = np.concatenate([pair.a.buf[o : o + n] for o, n in sges])
    source = digest(pair.a.buf)

    [wc] = pair.run([pair.wr(7, Opcode.RDMA_WRITE, sges, remote)])

    assert (wc.wr_id, wc.status, wc.opcode, wc.byte_len) == (7, WcStatus.SUCCESS, Opcode.RDMA_WRITE, total)
    assert wc.qp_num == pair.a.qp.qp_num
    assert digest(pair.b.buf) == digest(expected), "target differs (inside or outside the written range)"
    assert digest(pair.a.buf) == source, "a WRITE changed its source"


@pytest.mark.parametrize(("total", "nsge"), CASES, ids=[f"{t}B-{n}sge" for t, n in CASES])
def test_read_scatters_byte_identical(pairs: PairFactory, total: int, nsge: int) -> None:
    pair = pairs(total + 64 * nsge + 64, total + 64)
    nsge = min(nsge, pair.a.qp.max_sge)
    sges = scatter_list(total, nsge, seed=total + 1)
    remote = 13 if total + 13 <= len(pair.b.buf) else 0
    expected = pair.a.buf.copy()
    pos = remote
    for off, n in sges:  # READ responses scatter into the SGEs in list order
        expected[off : off + n] = pair.b.buf[pos : pos + n]
        pos += n
    target = digest(pair.b.buf)

    [wc] = pair.run([pair.wr(8, Opcode.RDMA_READ, sges, remote)])

    assert (wc.wr_id, wc.status, wc.opcode, wc.byte_len) == (8, WcStatus.SUCCESS, Opcode.RDMA_READ, total)
    assert digest(pair.a.buf) == digest(expected), "local buffer differs (inside or outside the SGEs)"
    assert digest(pair.b.buf) == target, "a READ changed the target"


def test_full_queue_of_mixed_requests_completes_in_order(pairs: PairFactory) -> None:
    pair = pairs(2 * MiB, 2 * MiB, sq_depth=128)
    depth = pair.a.qp.max_send_wr
    pair.a.buf[:MiB] = random_bytes(MiB, 5)
    chunk = MiB // depth
    wrs = []
    for i in range(depth):
        off = i * chunk
        if i % 2 == 0:  # A[off] -> B[off]
            wrs.append(pair.write(i, off, chunk, off))
        else:  # B[MiB + off] -> A[MiB + off]
            wrs.append(pair.read(i, MiB + off, chunk, MiB + off))
    expected_a = pair.a.buf.copy()
    expected_b = pair.b.buf.copy()
    for i in range(depth):
        off = i * chunk
        if i % 2 == 0:
            expected_b[off : off + chunk] = pair.a.buf[off : off + chunk]
        else:
            expected_a[MiB + off : MiB + off + chunk] = pair.b.buf[MiB + off : MiB + off + chunk]

    wcs = pair.run(wrs)

    assert wr_ids(wcs) == list(range(depth))
    assert set(statuses(wcs)) == {WcStatus.SUCCESS}
    assert digest(pair.a.buf) == digest(expected_a)
    assert digest(pair.b.buf) == digest(expected_b)


def test_long_stream_with_selective_signaling_stays_in_order(pairs: PairFactory) -> None:
    pair = pairs(MiB, MiB, sq_depth=32)
    depth = pair.a.qp.max_send_wr
    total, size, every = 3000, 4096, 8
    slots = MiB // size
    pair.a.buf[:] = random_bytes(MiB, 9)
    posted = completed_upto = 0
    seen: list[int] = []
    while completed_upto < total:
        room = depth - (posted - completed_upto)
        batch = []
        while room and posted < total:
            signaled = posted % every == every - 1 or posted == total - 1
            off = (posted % slots) * size
            batch.append(pair.write(posted, off, size, off, signaled=signaled))
            posted += 1
            room -= 1
        if batch:
            pair.a.qp.post_send(batch)
        for wc in pair.waiter.wait_some():
            assert wc.status is WcStatus.SUCCESS, wc
            seen.append(wc.wr_id)
            completed_upto = wc.wr_id + 1  # a signaled completion covers every earlier request
    assert seen == [i for i in range(total) if i % every == every - 1 or i == total - 1]
    assert digest(pair.b.buf) == digest(pair.a.buf)


def test_read_after_write_on_one_pair_sees_the_write(pairs: PairFactory) -> None:
    pair = pairs(MiB, MiB)
    pair.a.buf[:4096] = random_bytes(4096, 3)
    wcs = pair.run([pair.write(1, 0, 4096, 100, signaled=False), pair.read(2, 8192, 4096, 100)])
    assert wr_ids(wcs) == [2] and statuses(wcs) == [WcStatus.SUCCESS]
    assert np.array_equal(pair.a.buf[8192 : 8192 + 4096], pair.a.buf[:4096])


@pytest.mark.parametrize("block", [512, 4096, 65536])
def test_many_equal_blocks_land_as_if_one_after_another(pairs: PairFactory, block: int) -> None:
    """One batch of many equal-length, non-contiguous blocks, some of them overwriting earlier
    ones: every byte is what executing the requests in posting order gives, both ways."""
    n = 256
    pair = pairs(4 * n * block, 4 * n * block, sq_depth=2 * n)
    pair.a.buf[:] = random_bytes(len(pair.a.buf), 17)
    rng = np.random.default_rng(block)
    src = rng.permutation(4 * n)[:n] * block
    dst = rng.permutation(4 * n)[:n] * block
    dst[n // 2 :: 7] = dst[n // 4 : n // 4 + len(dst[n // 2 :: 7])] + block // 2  # overlap earlier blocks
    dst = np.minimum(dst, len(pair.b.buf) - block)
    expected = pair.b.buf.copy()
    for s, d in zip(src.tolist(), dst.tolist(), strict=True):
        expected[d : d + block] = pair.a.buf[s : s + block]
    pairs_ = enumerate(zip(src.tolist(), dst.tolist(), strict=True))
    wrs = [pair.write(i, s, block, d, signaled=i == n - 1) for i, (s, d) in pairs_]
    assert wr_ids(pair.run(wrs)) == [n - 1]
    assert digest(pair.b.buf) == digest(expected)

    back = 2 * n * block  # READ the written blocks back into a fresh area, in the same order
    reads = [pair.read(n + i, back + i * block, block, d, signaled=i == n - 1) for i, d in enumerate(dst.tolist())]
    assert wr_ids(pair.run(reads)) == [2 * n - 1]
    got = pair.a.buf[back : back + n * block].reshape(n, block)
    assert all(np.array_equal(got[i], expected[d : d + block]) for i, d in enumerate(dst.tolist()))
