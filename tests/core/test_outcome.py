"""Folding a transfer's request completions into one outcome, and the message a failure carries.

Written for the mutants of ``core/outcome.py`` that the first mutation run left alive: the folding
rules were pinned only through whole transfers, and nothing read a failure's message.
"""

from __future__ import annotations

import pytest

from moriio_async.core.outcome import Outcome, describe_wc_status
from moriio_async.status import StatusCode, WcStatus

S, FLUSH, ACCESS, RETRY = WcStatus.SUCCESS, WcStatus.WR_FLUSH_ERR, WcStatus.REM_ACCESS_ERR, WcStatus.RETRY_EXC_ERR


@pytest.mark.parametrize(
    ("statuses", "expected"),
    [
        ([S, S, S], S),
        ([S, ACCESS, FLUSH], ACCESS),  # the first failure
        ([ACCESS, RETRY], ACCESS),  # the first root cause stays
        ([FLUSH, ACCESS, S], ACCESS),  # a root cause beats a flush reported before it
        ([FLUSH, FLUSH], FLUSH),
        ([RETRY, FLUSH], RETRY),  # a later flush never replaces a root cause
    ],
)
def test_the_first_root_cause_is_the_outcome(statuses: list[WcStatus], expected: WcStatus) -> None:
    outcome = Outcome(len(statuses))
    ends = [outcome.add(1, s, vendor_err=i + 1, qp_num=0x100 + i) for i, s in enumerate(statuses)]
    assert ends == [False] * (len(statuses) - 1) + [True], "only the last completion ends the transfer"
    assert outcome.remaining == 0
    assert outcome.wc_status is expected
    assert outcome.code is (StatusCode.SUCCESS if expected is S else StatusCode.ERR_RDMA_OP)
    if expected is not S:
        # vendor_err and qp come with the status that won, not with a later completion
        first = statuses.index(expected)
        assert (outcome.vendor_err, outcome.qp_num) == (first + 1, 0x100 + first)
    else:
        assert (outcome.vendor_err, outcome.qp_num) == (0, None)


def test_a_completion_beyond_the_requests_is_refused() -> None:
    outcome = Outcome(1)
    assert outcome.add(1, S) is True
    with pytest.raises(RuntimeError, match=r"^more completions than work requests$"):
        outcome.add(1, S)
    assert outcome.remaining == 0


def test_defaults_of_a_completion_without_vendor_error_or_queue_pair() -> None:
    outcome = Outcome(1)
    outcome.add(1, ACCESS)
    assert (outcome.vendor_err, outcome.qp_num) == (0, None)
    assert outcome.message() == f"{describe_wc_status(ACCESS)} (wc status {int(ACCESS)}, vendor_err 0)"


def test_a_failure_message_names_status_reason_vendor_error_and_queue_pair() -> None:
    outcome = Outcome(2)
    outcome.add(1, S)
    outcome.add(1, ACCESS, vendor_err=7, qp_num=0x1A2)
    assert outcome.message() == (
        "REM_ACCESS_ERR: the peer rejected the access: wrong rkey, range outside its region, missing access "
        f"rights, or the region was deregistered (wc status {int(ACCESS)}, vendor_err 7, qp {0x1A2})"
    )
    success = Outcome(1)
    success.add(1, S)
    assert success.message() == ""


def test_statuses_without_a_known_reason_are_named_alone() -> None:
    assert describe_wc_status(WcStatus.REM_OP_ERR) == "REM_OP_ERR"
    assert describe_wc_status(FLUSH).startswith("WR_FLUSH_ERR: flushed")
    assert describe_wc_status(RETRY).startswith("RETRY_EXC_ERR: the peer stopped answering")
