"""The verbs backend's local scatter-entry check, vectorised over a batch, against the one-entry rule."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from moriio_async.backends.verbs.checks import covers, first_bad_local
from moriio_async.status import Access, Opcode
from moriio_async.work import Sge, WorkBatch, WorkRequest

REGIONS = {
    1: SimpleNamespace(addr=0x10000, length=0x1000, access=Access.all(), handle=object()),
    2: SimpleNamespace(addr=0x20000, length=0x800, access=Access.REMOTE_READ, handle=object()),  # no LOCAL_WRITE
    3: SimpleNamespace(addr=0x30000, length=0x1000, access=Access.all(), handle=None),  # deregistered
}


def lookup(lkey: int) -> Any:
    return REGIONS.get(lkey)


def check(wrs: list[WorkRequest]) -> int | None:
    batch = WorkBatch.from_requests(wrs)
    return first_bad_local(batch, lookup)


def oracle(wrs: list[WorkRequest]) -> int | None:
    for i, wr in enumerate(wrs):
        for s in wr.sges:
            region = lookup(s.lkey)
            if region is None or not covers(region, s.addr, s.length, write=wr.opcode is Opcode.RDMA_READ):
                return i
    return None


def wr(i: int, *sges: tuple[int, int, int], read: bool = False) -> WorkRequest:
    op = Opcode.RDMA_READ if read else Opcode.RDMA_WRITE
    return WorkRequest(i, op, tuple(Sge(a, n, k) for a, n, k in sges), 0, 9)


def test_examples_at_the_edges() -> None:
    assert check([wr(0, (0x10000, 0x1000, 1))]) is None
    assert check([wr(0, (0x10000, 0x1001, 1))]) == 0  # one byte past the end
    assert check([wr(0, (0xFFFF, 1, 1))]) == 0  # one byte before the start
    assert check([wr(0, (0x10000, 8, 1)), wr(1, (0x10FF8, 8, 1)), wr(2, (0x10FF9, 8, 1))]) == 2
    assert check([wr(0, (0x10000, 8, 1)), wr(1, (0x10000, 8, 1), (0x10100, 8, 7))]) == 1  # unknown lkey
    assert check([wr(0, (0x20000, 8, 2)), wr(1, (0x20000, 8, 2), read=True)]) == 1  # READ into no LOCAL_WRITE
    assert check([wr(0, (0x10000, 8, 1)), wr(1, (0x30000, 8, 3))]) == 1  # deregistered
    assert check([wr(0, (0x30000, 8, 3))]) == 0


entries = st.tuples(st.integers(0x0F000, 0x32000), st.integers(0, 0x1100), st.sampled_from([1, 1, 1, 2, 3, 4]))


@given(st.lists(st.tuples(st.lists(entries, min_size=1, max_size=4), st.booleans()), min_size=1, max_size=12))
def test_the_vectorised_check_finds_the_first_bad_request_as_a_loop_would(reqs: list[Any]) -> None:
    wrs = [wr(i, *sges, read=read) for i, (sges, read) in enumerate(reqs)]
    assert check(wrs) == oracle(wrs)
