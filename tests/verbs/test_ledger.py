"""The per-pair ledger: slot accounting, covering, and made-up completions stay in posting order."""

from __future__ import annotations

from moriio_async.backends.verbs.ledger import FENCE_WR_ID, SendLedger
from moriio_async.status import Opcode, WcStatus
from moriio_async.work import Sge, WorkBatch, WorkRequest


def _wr(wr_id: int, *, signaled: bool = True, opcode: Opcode = Opcode.RDMA_WRITE, size: int = 64) -> WorkRequest:
    return WorkRequest(wr_id, opcode, (Sge(0x1000, size, 1),), 0x2000, 2, signaled)


def _b(*wrs: WorkRequest) -> WorkBatch:
    return WorkBatch.from_requests(wrs)


def test_signaled_completion_covers_earlier_unsignaled_requests() -> None:
    ledger = SendLedger(qp_num=7, depth=4)
    ledger.posted(_b(_wr(1, signaled=False), _wr(2, signaled=False), _wr(3)))
    assert ledger.free == 1
    wc = ledger.complete(3, WcStatus.SUCCESS, 0, 0)
    assert wc is not None
    assert (wc.wr_id, wc.status, wc.byte_len, wc.qp_num, wc.opcode) == (3, WcStatus.SUCCESS, 64, 7, Opcode.RDMA_WRITE)
    assert ledger.free == 4


def test_error_completion_keeps_the_posted_opcode_and_reports_no_bytes() -> None:
    ledger = SendLedger(qp_num=7, depth=4)
    ledger.posted(_b(_wr(1, opcode=Opcode.RDMA_READ)))
    wc = ledger.complete(1, WcStatus.REM_ACCESS_ERR, 0x55, 12345)
    assert wc is not None
    assert (wc.opcode, wc.byte_len, wc.vendor_err) == (Opcode.RDMA_READ, 0, 0x55)
    assert ledger.errored


def test_unknown_completion_is_dropped() -> None:
    ledger = SendLedger(qp_num=7, depth=4)
    ledger.posted(_b(_wr(1)))
    assert ledger.complete(99, WcStatus.SUCCESS, 0, 0) is None
    assert ledger.outstanding == 1


def test_kill_fails_everything_outstanding_in_order_then_ignores_the_hardware() -> None:
    ledger = SendLedger(qp_num=3, depth=8)
    ledger.posted(_b(_wr(1, signaled=False), _wr(2, signaled=False), _wr(3)))
    ledger.kill(WcStatus.FATAL_ERR)
    assert ledger.free == 5  # made-up completions hold their slots until polled
    out = ledger.take_synth(10)
    assert [(w.wr_id, w.status) for w in out] == [
        (1, WcStatus.FATAL_ERR),
        (2, WcStatus.WR_FLUSH_ERR),
        (3, WcStatus.WR_FLUSH_ERR),
    ]
    assert ledger.complete(3, WcStatus.WR_FLUSH_ERR, 0, 0) is None
    assert ledger.free == 8


def test_refused_posts_wait_for_earlier_hardware_completions() -> None:
    ledger = SendLedger(qp_num=3, depth=8)
    ledger.posted(_b(_wr(1)))
    ledger.refused(_b(_wr(2), _wr(3)), WcStatus.WR_FLUSH_ERR)
    assert ledger.must_synthesize
    assert ledger.take_synth(10) == []  # wr 1 has not completed yet: order first
    first = ledger.complete(1, WcStatus.WR_FLUSH_ERR, 0, 0)
    assert first is not None
    assert [w.wr_id for w in ledger.take_synth(10)] == [2, 3]
    assert ledger.free == 8


def test_after_an_error_made_up_completions_are_flushes() -> None:
    ledger = SendLedger(qp_num=3, depth=8)
    ledger.posted(_b(_wr(1), _wr(2)))
    ledger.complete(1, WcStatus.RETRY_EXC_ERR, 0, 0)
    ledger.kill(WcStatus.FATAL_ERR)
    assert [w.status for w in ledger.take_synth(10)] == [WcStatus.WR_FLUSH_ERR]


def test_take_synth_respects_max_entries() -> None:
    ledger = SendLedger(qp_num=3, depth=8)
    ledger.refused(_b(*[_wr(i) for i in range(5)]), WcStatus.LOC_QP_OP_ERR)
    assert [w.wr_id for w in ledger.take_synth(2)] == [0, 1]
    assert ledger.held == 3
    assert [w.status for w in ledger.take_synth(9)] == [WcStatus.WR_FLUSH_ERR] * 3


def test_fence_covers_unsignaled_successes_so_made_up_completions_are_delivered() -> None:
    ledger = SendLedger(qp_num=3, depth=4)
    ledger.posted(_b(_wr(0, signaled=False)))  # succeeded on the wire: no completion will ever come
    ledger.refused(_b(_wr(1), _wr(2)), WcStatus.LOC_PROT_ERR)
    ledger.fence()
    assert ledger.held == 3  # the fence holds no slot of the caller's
    assert ledger.take_synth(10) == []
    assert ledger.complete(FENCE_WR_ID, WcStatus.WR_FLUSH_ERR, 0, 0) is None
    assert [(w.wr_id, w.status) for w in ledger.take_synth(10)] == [
        (1, WcStatus.LOC_PROT_ERR),
        (2, WcStatus.WR_FLUSH_ERR),
    ]
    assert ledger.free == 4


def test_spans_cover_across_posts_and_partial_posts_keep_their_positions() -> None:
    ledger = SendLedger(qp_num=5, depth=16)
    first = _b(*[_wr(i, signaled=False, size=100 + i) for i in range(10, 14)])
    ledger.posted(first, 3)  # the device took 3 of 4
    ledger.refused(first, WcStatus.LOC_PROT_ERR, 3)
    assert (ledger.outstanding, ledger.held) == (3, 4)
    wc = ledger.complete(11, WcStatus.SUCCESS, 0, 0)  # covers 10 and 11, leaves 12
    assert wc is not None and (wc.wr_id, wc.byte_len) == (11, 111)
    assert ledger.outstanding == 1
    assert ledger.take_synth(9) == []  # 12 is still with the hardware
    assert ledger.complete(12, WcStatus.WR_FLUSH_ERR, 0, 0) is not None
    assert [(w.wr_id, w.status) for w in ledger.take_synth(9)] == [(13, WcStatus.LOC_PROT_ERR)]
    assert ledger.free == 16


def test_a_completion_covers_earlier_spans_whole() -> None:
    ledger = SendLedger(qp_num=5, depth=16)
    ledger.posted(_b(*[_wr(i, signaled=False) for i in range(4)]))
    ledger.posted(_b(*[_wr(i, opcode=Opcode.RDMA_READ) for i in range(4, 8)]))
    wc = ledger.complete(5, WcStatus.SUCCESS, 0, 77)
    assert wc is not None and (wc.opcode, wc.byte_len) == (Opcode.RDMA_READ, 77)
    assert ledger.outstanding == 2
    assert "6..7" in ledger.describe()


def test_kill_puts_hardware_requests_before_earlier_made_up_ones() -> None:
    ledger = SendLedger(qp_num=5, depth=16)
    ledger.posted(_b(_wr(1), _wr(2)))
    ledger.refused(_b(_wr(3)), WcStatus.LOC_PROT_ERR)
    ledger.kill(WcStatus.FATAL_ERR)
    assert [(w.wr_id, w.status) for w in ledger.take_synth(9)] == [
        (1, WcStatus.WR_FLUSH_ERR),  # an error was already made up (3): later ones are flushes
        (2, WcStatus.WR_FLUSH_ERR),
        (3, WcStatus.LOC_PROT_ERR),
    ]
    assert ledger.held == 0
