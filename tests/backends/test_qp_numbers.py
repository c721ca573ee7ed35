"""Queue-pair numbers carry the backend's place in its engine (``BackendOptions.qp_tag``), so the pairs
of one engine's several backends never share a number, and nothing wraps a pair to say which it is."""

from __future__ import annotations

import pytest

from moriio_async.backends.base import QP_MASK, TAG_SHIFT
from moriio_async.status import Opcode, WcStatus

from .harness import PairFactory

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("tag", [0, 3])
def test_a_pair_is_numbered_with_its_backends_tag_and_completes_under_that_number(pairs: PairFactory, tag: int) -> None:
    pair = pairs(4096, 4096, qp_tag=tag)

    [wc] = pair.run([pair.wr(1, Opcode.RDMA_WRITE, [(0, 64)], 0)])

    assert (pair.a.qp.qp_num >> TAG_SHIFT, pair.b.qp.qp_num >> TAG_SHIFT) == (tag, tag)
    assert wc.status == WcStatus.SUCCESS
    # The device's own number (verbs) is the low bits; software NICs complete under the whole number.
    assert wc.qp_num & QP_MASK == pair.a.qp.qp_num & QP_MASK


@pytest.mark.only_backends("mock", "tcp", "cma", reason="software NICs count their pairs themselves")
def test_two_backends_with_different_tags_hand_out_different_numbers(pairs: PairFactory) -> None:
    first = pairs(4096, 4096, qp_tag=0)
    second = pairs(4096, 4096, qp_tag=1)

    assert {first.a.qp.qp_num >> TAG_SHIFT, second.a.qp.qp_num >> TAG_SHIFT} == {0, 1}
    assert first.a.qp.qp_num != second.a.qp.qp_num
