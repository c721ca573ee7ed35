"""A cma queue pair's chunks, cut as its executing thread takes them (``Span.next_chunk``): one opcode,
about ``max_bytes`` of payload but at least one request, at most IOV_MAX requests and at most IOV_MAX
local SGEs, so one window's checks and iovecs stay within what one cross-memory-attach call takes.

No threads and no peer: the span is cut directly, as the worker does under the pair's lock."""

from __future__ import annotations

import pytest

from moriio_async.backends.cma.kernel import IOV_MAX
from moriio_async.backends.cma.pairstate import Span
from moriio_async.status import Opcode
from moriio_async.work import Sge, WorkBatch, WorkRequest

pytestmark = pytest.mark.only_backends("cma", reason="unit tests of the cma pair state's chunks")

W, R = Opcode.RDMA_WRITE, Opcode.RDMA_READ
ANY_BYTES = 1 << 40


def batch(ops: list[Opcode], sges: int = 1, length: int = 64) -> WorkBatch:
    """One request per opcode, each with ``sges`` scatter entries of ``length`` bytes."""
    return WorkBatch.from_requests(
        [
            WorkRequest(i, op, tuple(Sge(0x1000 + k * length, length, 3) for k in range(sges)), 0x2000, 9)
            for i, op in enumerate(ops)
        ]
    )


def chunks(span: Span, max_bytes: int = ANY_BYTES) -> list[int]:
    """Where each chunk ends, taking them one after another."""
    ends = []
    while span.pos < len(span.batch):
        span.pos = span.next_chunk(max_bytes)
        ends.append(span.pos)
    return ends


def test_a_chunk_holds_at_most_iov_max_local_sges(backend_name: str) -> None:
    # Two SGEs a request: IOV_MAX // 2 requests fill a chunk's SGEs exactly; the rest is the next chunk.
    n = IOV_MAX // 2 + 88
    assert chunks(Span(batch([W] * n, sges=2), 0)) == [IOV_MAX // 2, n]
    # Three a request: the chunk stops before the request that would pass IOV_MAX.
    n = IOV_MAX // 3 + 5
    assert chunks(Span(batch([R] * n, sges=3), 0)) == [IOV_MAX // 3, n]


def test_a_chunk_holds_at_most_iov_max_requests_one_opcode_and_about_max_bytes(backend_name: str) -> None:
    assert chunks(Span(batch([W] * (IOV_MAX + 3)), 0)) == [IOV_MAX, IOV_MAX + 3]
    assert chunks(Span(batch([W, W, R, R, R, W]), 0)) == [2, 5, 6]
    assert chunks(Span(batch([W] * 10, length=100), 0), max_bytes=250) == [2, 4, 6, 8, 10]
    assert chunks(Span(batch([R, R], length=1000), 0), max_bytes=10) == [1, 2]  # at least one request


def test_a_span_the_poster_found_whole_is_one_chunk(backend_name: str) -> None:
    span = Span(batch([W] * 40, sges=4), 0)
    span.whole = True
    assert chunks(span) == [40]
