"""The software NICs' shared pieces (``backends/soft/pair.py``): shape checks and success folding."""

from __future__ import annotations

import numpy as np
import pytest

from moriio_async.backends.soft.pair import check_shape, fold_successes
from moriio_async.errors import InvalidArgument
from moriio_async.status import Opcode, WcStatus
from moriio_async.work import Sge, WorkBatch, WorkRequest


def _batch(signaled: list[bool], *, sges: int = 1, opcode: int | None = None) -> WorkBatch:
    batch = WorkBatch.from_requests(
        [
            WorkRequest(100 + i, Opcode.RDMA_READ if i == 1 else Opcode.RDMA_WRITE,
                        tuple(Sge(4096 * i + j, 8, 7) for j in range(sges)), 0x1000 + 64 * i, 9, s)
            for i, s in enumerate(signaled)
        ]
    )  # fmt: skip
    if opcode is not None:  # an opcode no software NIC carries (IBV_WR_SEND)
        batch.opcode = np.full(len(batch), opcode, dtype=np.uint8)
    return batch


def test_successes_fold_into_their_signaled_completions_with_the_slots_each_frees() -> None:
    batch = _batch([False, True, False, False, True, False])
    out, left = fold_successes(batch, 0, 6, 2, 5)  # two earlier successes were left uncovered
    assert [(wc.wr_id, wc.opcode, wc.status, wc.byte_len, wc.qp_num, slots) for wc, slots in out] == [
        (101, Opcode.RDMA_READ, WcStatus.SUCCESS, 8, 5, 4),  # 2 earlier + requests 0 and 1
        (104, Opcode.RDMA_WRITE, WcStatus.SUCCESS, 8, 5, 3),  # requests 2, 3 and 4
    ]
    assert left == 1  # request 5 waits for the next completion
    assert fold_successes(batch, 5, 6, left, 5) == ([], 2)  # one unsignaled success: nothing pushed
    out, left = fold_successes(batch, 4, 5, 0, 5)
    assert [(wc.wr_id, slots) for wc, slots in out] == [(104, 1)] and left == 0
    assert fold_successes(batch, 2, 4, 3, 5) == ([], 5)


def test_a_post_with_an_unsupported_opcode_or_too_many_sges_is_refused() -> None:
    check_shape(_batch([True]), 1, 3)
    check_shape(_batch([True, True, True], sges=2), 2, 3)
    with pytest.raises(InvalidArgument, match="3 SGEs, qp 3 takes at most 2"):
        check_shape(_batch([True], sges=3), 2, 3)
    with pytest.raises(InvalidArgument, match="3 SGEs, qp 3 takes at most 2"):
        check_shape(_batch([True, True], sges=3), 2, 3)
    with pytest.raises(InvalidArgument, match="unsupported opcode"):
        check_shape(_batch([True], opcode=2), 1, 3)
    with pytest.raises(InvalidArgument, match="unsupported opcode"):
        check_shape(_batch([True, True, True], opcode=2), 1, 3)
