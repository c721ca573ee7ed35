"""A whole chunk per post on real verbs: extended-QP sections, scatter lists, and the plain-QP path.

rdma-core 59's rxe ``wr_set_sge_list`` takes the first scatter entry's length
times their number as a request's length (tools/guest/PYVERBS_NOTES.md), so a
request whose entries differ in length must be posted another way; these tests
would see the wrong bytes land if it were not.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from moriio_async.backends import open_backend
from moriio_async.backends.base import Backend, QueuePair, SendQueueFull
from moriio_async.errors import InvalidArgument
from moriio_async.status import Access, Opcode, WcStatus
from moriio_async.work import Sge, WorkBatch, WorkRequest

from .conftest import IN_GUEST, NOT_IN_GUEST, connect, drain, guest_only, guest_options

pytestmark = guest_only
SIZE = 1 << 20


@pytest.fixture(params=[True, False], ids=["extended-qp", "plain-qp"])
def verbs(request: pytest.FixtureRequest) -> Iterator[Backend]:
    if not IN_GUEST:
        pytest.skip(NOT_IN_GUEST)
    opened = open_backend("verbs", guest_options(retry_cnt=3, extended_qp=request.param))
    yield opened
    opened.close()


def test_a_chunk_with_mixed_scatter_lists_moves_exactly_its_bytes(verbs: Backend) -> None:
    src_buf, dst_buf = bytearray(os.urandom(SIZE)), bytearray(SIZE)
    src = verbs.register_memory(memoryview(src_buf), Access.all())
    dst = verbs.register_memory(memoryview(dst_buf), Access.all())
    cq = verbs.create_cq(1024)
    active, _passive = connect(verbs, cq)
    # rxe offers the extended QP: with it asked for, the pair has it (the other run: a plain QP).
    assert getattr(active, "handle").extended is getattr(verbs, "extended_qp")  # noqa: B009
    k = 4096

    def sges(*pieces: tuple[int, int]) -> tuple[Sge, ...]:
        return tuple(Sge(src.addr + off, n, src.lkey) for off, n in pieces)

    wrs = [
        WorkRequest(1, Opcode.RDMA_WRITE, sges((0, k)), dst.addr, dst.rkey, False),
        WorkRequest(2, Opcode.RDMA_WRITE, sges((8 * k, 1024), (16 * k, 3072)), dst.addr + k, dst.rkey, False),
        WorkRequest(3, Opcode.RDMA_WRITE, sges((24 * k, 2048), (32 * k, 2048)), dst.addr + 2 * k, dst.rkey, False),
        WorkRequest(4, Opcode.RDMA_WRITE, sges((40 * k, 3072), (48 * k, 1024)), dst.addr + 3 * k, dst.rkey, False),
        WorkRequest(
            5, Opcode.RDMA_WRITE, sges((56 * k, 100), (57 * k, 200), (58 * k, 300)), dst.addr + 4 * k, dst.rkey, False
        ),
        WorkRequest(6, Opcode.RDMA_READ, sges((64 * k, 2048), (72 * k, 2048)), dst.addr + 5 * k, dst.rkey, True),
    ]
    dst_buf[5 * k : 6 * k] = os.urandom(k)
    active.post(WorkBatch.from_requests(wrs))
    wcs = drain(cq, 1, 30)
    assert [(w.wr_id, w.status, w.opcode, w.byte_len) for w in wcs] == [(6, WcStatus.SUCCESS, Opcode.RDMA_READ, k)]

    def gathered(*pieces: tuple[int, int]) -> bytes:
        return b"".join(bytes(src_buf[off : off + n]) for off, n in pieces)

    assert dst_buf[0:k] == src_buf[0:k]
    assert dst_buf[k : 2 * k] == gathered((8 * k, 1024), (16 * k, 3072))
    assert dst_buf[2 * k : 3 * k] == gathered((24 * k, 2048), (32 * k, 2048))
    assert dst_buf[3 * k : 4 * k] == gathered((40 * k, 3072), (48 * k, 1024))
    assert dst_buf[4 * k : 4 * k + 600] == gathered((56 * k, 100), (57 * k, 200), (58 * k, 300))
    assert dst_buf[4 * k + 600 : 5 * k] == bytes(k - 600), "a write moved more than its length"
    assert src_buf[64 * k : 64 * k + 2048] + src_buf[72 * k : 72 * k + 2048] == dst_buf[5 * k : 6 * k]


def test_a_long_chunk_lands_whole_and_one_signaled_completion_frees_every_slot(verbs: Backend) -> None:
    src_buf, dst_buf = bytearray(os.urandom(SIZE)), bytearray(SIZE)
    src = verbs.register_memory(memoryview(src_buf), Access.all())
    dst = verbs.register_memory(memoryview(dst_buf), Access.all())
    cq = verbs.create_cq(1024)
    active, _passive = connect(verbs, cq)
    n, block = active.max_send_wr, 1024
    wrs = [
        WorkRequest(100 + i, Opcode.RDMA_WRITE, (Sge(src.addr + 2 * i * block, block, src.lkey),),
                    dst.addr + i * block, dst.rkey, i == n - 1)
        for i in range(n)
    ]  # fmt: skip
    active.post(WorkBatch.from_requests(wrs))
    (wc,) = drain(cq, 1, 60)
    assert (wc.wr_id, wc.status, wc.byte_len) == (100 + n - 1, WcStatus.SUCCESS, block)
    for i in range(n):
        assert dst_buf[i * block : (i + 1) * block] == src_buf[2 * i * block : (2 * i + 1) * block], i
    active.post_send([WorkRequest(9, Opcode.RDMA_WRITE, (Sge(src.addr, 8, src.lkey),), dst.addr, dst.rkey)])
    assert [w.wr_id for w in drain(cq, 1, 10)] == [9]


def test_bad_shapes_are_refused_whole_before_anything_is_posted(verbs: Backend) -> None:
    src_buf = bytearray(SIZE)
    src = verbs.register_memory(memoryview(src_buf), Access.all())
    cq = verbs.create_cq(64)
    active, _passive = connect(verbs, cq)
    one = (Sge(src.addr, 8, src.lkey),)
    good = WorkRequest(1, Opcode.RDMA_WRITE, one, src.addr, src.rkey, False)
    too_many = (Sge(src.addr, 8, src.lkey),) * (active.max_sge + 1)
    for bad in (
        WorkRequest(2, Opcode.RDMA_WRITE, (), src.addr, src.rkey),
        WorkRequest(2, Opcode.RDMA_WRITE, too_many, src.addr, src.rkey),
        WorkRequest(2, Opcode.RDMA_WRITE, (Sge(src.addr, 1 << 32, src.lkey),), src.addr, src.rkey),
    ):
        with pytest.raises(InvalidArgument):
            active.post(WorkBatch.from_requests([good, bad]))
    batch = WorkBatch.from_requests([good, WorkRequest(2, Opcode.RDMA_WRITE, one, src.addr, src.rkey)])
    with pytest.raises(InvalidArgument, match="opcode"):
        active.post(WorkBatch(1, batch.opcode | 1, batch.remote_addr, batch.rkey, batch.length, batch.signaled,
                              batch.sge_start, batch.sge_addr, batch.sge_length, batch.sge_lkey))  # fmt: skip
    assert drain(cq, 1, 0.5) == []  # nothing was posted
    active.post(batch)
    assert [w.wr_id for w in drain(cq, 1, 10)] == [2]


def test_each_posted_section_signals_exactly_its_own_signaled_requests(verbs: Backend) -> None:
    """A chunk cut into several posted pieces (extended QP: a section, a request whose scatter entries differ
    in length posted alone, another section...; plain QP: one post per request), signaled at positions no two
    pieces share: the completions name exactly the signaled requests, so a flag taken from the wrong
    position (one section off, one request off) shows as a wrong or missing wr_id."""
    src_buf, dst_buf = bytearray(os.urandom(SIZE)), bytearray(SIZE)
    src = verbs.register_memory(memoryview(src_buf), Access.all())
    dst = verbs.register_memory(memoryview(dst_buf), Access.all())
    cq = verbs.create_cq(1024)
    active, _passive = connect(verbs, cq)
    k, n = 4096, 12
    odd = {3, 7}  # scatter entries of different lengths: each posted between two sections
    signaled = {0, 3, 6, 9, 11}  # sections [0, 3), [4, 7), [8, 12): a different pattern in each

    def sges(i: int) -> tuple[Sge, ...]:
        if i in odd:
            return (Sge(src.addr + 2 * i * k, 1024, src.lkey), Sge(src.addr + (2 * i + 1) * k, 3072, src.lkey))
        return (Sge(src.addr + 2 * i * k, k, src.lkey),)

    wrs = [
        WorkRequest(200 + i, Opcode.RDMA_WRITE, sges(i), dst.addr + i * k, dst.rkey, i in signaled) for i in range(n)
    ]
    active.post(WorkBatch.from_requests(wrs))
    wcs = drain(cq, len(signaled), 30)
    assert drain(cq, 1, 0.5) == []  # and nothing more
    assert [(w.wr_id, w.status) for w in wcs] == [(200 + i, WcStatus.SUCCESS) for i in sorted(signaled)]
    for i in range(n):
        want = b"".join(bytes(src_buf[s.addr - src.addr : s.addr - src.addr + s.length]) for s in sges(i))
        assert dst_buf[i * k : (i + 1) * k] == want, i


def _as_batch(qp: QueuePair) -> Callable[[int, Opcode, int, int, int, int, int], None]:
    def post(wr_id: int, opcode: Opcode, local: int, lkey: int, remote: int, rkey: int, length: int) -> None:
        qp.post(WorkBatch.one(wr_id, opcode, local, lkey, remote, rkey, length))

    return post


def test_post_one_ends_as_post_of_the_one_request_batch(verbs: Backend) -> None:
    """``post_one`` (the single read or write, posted on plain integers) against ``post`` of
    ``WorkBatch.one`` of the same values: the same bytes and completion (wr_id, status, opcode,
    byte_len) for a WRITE and a READ, the same LOC_PROT_ERR for a local entry outside its region
    with nothing moved, a flush for everything after it, the same refusal of an unknown opcode and
    of a full send queue, and completions in posting order when single ops and a batch mix."""
    src_buf, dst_buf = bytearray(os.urandom(SIZE)), bytearray(SIZE)
    src = verbs.register_memory(memoryview(src_buf), Access.all())
    dst = verbs.register_memory(memoryview(dst_buf), Access.all())
    k = 4096
    seen = []
    for how in ("one", "batch"):
        cq = verbs.create_cq(1024)
        active, _passive = connect(verbs, cq)
        post = active.post_one if how == "one" else _as_batch(active)
        dst_buf[:] = bytes(SIZE)
        src_buf[8 * k : 9 * k] = os.urandom(k)
        post(1, Opcode.RDMA_WRITE, src.addr, src.lkey, dst.addr + k, dst.rkey, k)
        dst_buf[2 * k : 3 * k] = os.urandom(k)
        post(2, Opcode.RDMA_READ, src.addr + 8 * k, src.lkey, dst.addr + 2 * k, dst.rkey, 3 * k // 4)
        wcs: list[tuple[object, ...]] = [(w.wr_id, w.status, w.opcode, w.byte_len) for w in drain(cq, 2, 30)]
        assert dst_buf[k : 2 * k] == src_buf[:k] and dst_buf[:k] == bytes(k)
        assert src_buf[8 * k : 8 * k + 3 * k // 4] == dst_buf[2 * k : 2 * k + 3 * k // 4]
        with pytest.raises(InvalidArgument):
            post(3, 9, src.addr, src.lkey, dst.addr, dst.rkey, 8)  # type: ignore[arg-type]
        before = bytes(dst_buf[3 * k : 4 * k])
        post(3, Opcode.RDMA_WRITE, src.addr + SIZE - 8, src.lkey, dst.addr + 3 * k, dst.rkey, 16)  # past the end
        post(4, Opcode.RDMA_WRITE, src.addr, src.lkey, dst.addr + 3 * k, dst.rkey, 8)
        wcs += [(w.wr_id, w.status) for w in drain(cq, 2, 30)]
        assert bytes(dst_buf[3 * k : 4 * k]) == before, "a refused request moved bytes"
        seen.append(wcs)
        active.close()
    assert seen[0] == seen[1]
    assert seen[0] == [
        (1, WcStatus.SUCCESS, Opcode.RDMA_WRITE, k),
        (2, WcStatus.SUCCESS, Opcode.RDMA_READ, 3 * k // 4),
        (3, WcStatus.LOC_PROT_ERR),
        (4, WcStatus.WR_FLUSH_ERR),
    ]
    cq = verbs.create_cq(1024)
    active, _passive = connect(verbs, cq)
    for i in range(active.max_send_wr):  # single ops and a batch in one queue: completions in order
        if i % 3:
            active.post_one(10 + i, Opcode.RDMA_WRITE, src.addr + i * 8, src.lkey, dst.addr + i * 8, dst.rkey, 8)
        else:
            active.post(WorkBatch.one(10 + i, Opcode.RDMA_WRITE, src.addr + i * 8, src.lkey, dst.addr + i * 8,
                                      dst.rkey, 8))  # fmt: skip
    with pytest.raises(SendQueueFull):
        active.post_one(9, Opcode.RDMA_WRITE, src.addr, src.lkey, dst.addr, dst.rkey, 8)
    n = active.max_send_wr
    assert [w.wr_id for w in drain(cq, n, 60)] == [10 + i for i in range(n)]
    active.post_one(9, Opcode.RDMA_WRITE, src.addr, src.lkey, dst.addr, dst.rkey, 8)  # every slot came back
    assert [w.wr_id for w in drain(cq, 1, 10)] == [9]
