"""Deadline and exact accounting of ``waiting_for_transfer_complete`` on the held mock NIC.

The NIC runs, fails or loses requests at times keyed to the wait's own
deadline (see ``scenario.py``); on asyncio the clock is virtual, so these
run without sleeping.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import example, given

from moriio_async import MockOptions, TransferError, TransferFailed, WcStatus, waiting_for_transfer_complete

from ..engine.conftest import make_pair
from .conftest import needs_held_mock
from .model import NicStep, held_qp
from .scenario import Scenario, Timed, run, scenarios

pytestmark = needs_held_mock


@given(scenarios)
async def test_deadline_is_kept_however_completions_are_scheduled(sc: Scenario) -> None:
    """waiting_for_transfer_complete(ts, timeout=T) never returns or raises later than T plus a small
    bound, however completions are scheduled, and never raises a timeout before T; it returns before T
    only when every transfer has ended, or with fail_fast when a failure came first (at once when the
    failure came before the wait); and when everything ends before T it returns with the last completion,
    not at T (unless the completion channel lost the wakeups: a silent CQ is only drained at T)."""
    r = await run(sc)
    assert r.elapsed <= r.timeout + r.bound, f"returned {r.elapsed - r.timeout:.3f}s after the deadline"
    if r.error is not None and r.error.timed_out:
        assert r.deadline_reached, f"timeout declared {r.timeout - r.elapsed:.6f}s before the deadline"
    if not sc.silent and all(s is not None for s in r.at_return.values()):
        # Everything ended before the deadline: the wait ends with the last completion, not at T.
        assert r.end <= r.last_step + r.bound, f"returned {r.end - r.last_step:.3f}s after the last completion"
    if sc.fail_fast and r.failed_before:
        assert r.elapsed <= r.bound, "fail_fast waited although a transfer had already failed"
    if not r.deadline_reached:
        ended = all(s is not None for s in r.at_return.values())
        failed_first = sc.fail_fast and any(s not in (None, WcStatus.SUCCESS) for s in r.at_return.values())
        assert ended or failed_first, "returned before the deadline with transfers still pending"


@given(scenarios)
@example(  # found by this property: a fail_fast wait ended by a failure did not drain a flush already queued
    Scenario(
        wrs=[1, 1],
        first=[NicStep("fail", 1, WcStatus.REM_ACCESS_ERR)],
        timed=[Timed(True, 0.0, NicStep("run", 1))],
        fail_fast=True,
        silent=False,
        t_virtual=1.0,
        t_real=0.03125,
    )
)
@example(  # timeout=0, fail_fast, a failure known before the wait: the failure ends it, nothing timed out
    Scenario(
        wrs=[1, 1],
        first=[NicStep("fail", 1, WcStatus.REM_ACCESS_ERR)],
        timed=[],
        fail_fast=True,
        silent=False,
        t_virtual=1.0,
        t_real=0.03125,
        settle=True,
        zero=True,
    )
)
async def test_error_lists_exactly_what_had_not_succeeded_at_the_deadline(sc: Scenario) -> None:
    """The TransferError lists exactly the transfers that had not succeeded when the wait ended: each
    in exactly one of .failed (with its real status) or .timed_out; a transfer that succeeded never
    appears; a completion already in the CQ at the deadline counts as what it is, not as a timeout;
    and the timed-out transfers go on, so waiting again gives their real outcomes. A transfer given to
    the wait twice is still one transfer. A timeout of 0 is a deadline already passed."""
    r = await run(sc)
    # What the runtime says at the moment the wait ended is what the NIC had done by then.
    assert r.at_return == r.expected
    pending = {i for i, s in r.expected.items() if s is None}
    failed = {i for i, s in r.expected.items() if s is not None and s is not WcStatus.SUCCESS}
    if r.error is None:
        assert not pending and not failed
    else:
        err = r.error
        got_failed = [e.transfer_id for e in err.failed]
        got_timed_out = [e.transfer_id for e in err.timed_out]
        assert len(set(got_failed)) == len(got_failed) and len(set(got_timed_out)) == len(got_timed_out)
        assert set(got_failed).isdisjoint(got_timed_out)
        assert set(got_failed) == failed
        for e in err.failed:
            assert e.wc_status is r.expected[e.transfer_id]
        # A failure known before a fail_fast wait ends it first, even with timeout=0 (whose deadline has
        # passed too): the failure came first. A failure only the final drain finds hides nothing.
        if (r.deadline_reached and not (sc.fail_fast and r.failed_before)) or not sc.fail_fast:
            assert set(got_timed_out) == pending
        else:
            assert got_timed_out == [], "fail_fast ended the wait early: nothing has timed out yet"
        assert len(err.exceptions) == len(got_failed) + len(got_timed_out)
        assert err.total == len(r.transfers)
        assert str(err).startswith(f"{len(err.exceptions)}/{len(r.transfers)} transfers failed:")
    # Timed-out transfers still run: they stay counted, and their buffers stay pinned until they end.
    assert r.outstanding == len(pending)
    assert r.refused_deregistration == bool(pending), "a transfer that had not ended let its buffer go"
    assert r.final == r.expected_final
    assert all(s is not None for s in r.final.values())


async def test_fail_fast_wait_that_reaches_its_deadline_lists_the_timeouts_too() -> None:
    """Found by the accounting property: with fail_fast, a failure that is first seen by the wait's
    final drain (its completion sat in the CQ) must not hide the transfers that timed out."""
    a, b, p = await make_pair("mock", mock=MockOptions(hold=True, silent_cq=True))
    try:
        first, second = p.session.read(0, 0, 8), p.session.read(16, 16, 8)
        qp = held_qp(p.session)
        qp.fail_next(WcStatus.REM_ACCESS_ERR)
        qp.step(1)  # the failure sits in the CQ; no channel event; the second stays held
        with pytest.raises(TransferError) as info:
            await waiting_for_transfer_complete([first, second], timeout=0.05, fail_fast=True)
        assert [e.transfer_id for e in info.value.failed] == [first.id]
        assert [e.transfer_id for e in info.value.timed_out] == [second.id]
    finally:
        await a.close()
        await b.close()


async def test_fail_fast_wait_ends_at_once_when_a_transfer_had_already_failed() -> None:
    """With fail_fast, a failure known before the wait began ends the wait at once, as the first
    failure does while waiting: the caller is not held to the deadline by the others."""
    a, b, p = await make_pair("mock", mock=MockOptions(hold=True))
    try:
        first, second = p.session.read(0, 0, 8), p.session.read(16, 16, 8)
        qp = held_qp(p.session)
        qp.fail_next(WcStatus.REM_ACCESS_ERR)
        qp.step(1)
        with pytest.raises(TransferFailed):
            await first
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(TransferError) as info:
            await waiting_for_transfer_complete([first, second], timeout=5, fail_fast=True)
        assert loop.time() - start < 1.0
        assert [e.transfer_id for e in info.value.failed] == [first.id]
        assert info.value.timed_out == []
    finally:
        await a.close()
        await b.close()
