"""A queue pair that fails at any point of a WRITE stream, whatever fails it (issue 23, item 1).

Property: for a random failure (the target deregisters the region being written, a request
answered REM_ACCESS_ERR, the target's pair gone, a local ``to_error``) before a random post of a
stream of random-sized single WRITEs, on every backend: each request ends exactly once (successes,
then the failure, then flushes), no pin is left on either side's buffer once the stream ended,
deregistering the initiator's buffer returns, and closing both backends returns.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ..backends.failing import FAILURES, assert_ended_once_in_rc_order, own_pins, returns, stream_and_fail
from ..backends.harness import PairFactory, backend_names

pytestmark = pytest.mark.timeout(240)

SIZE = 16 << 20


@pytest.mark.parametrize("backend", backend_names())
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    failure=st.sampled_from(FAILURES),
    fail_at=st.integers(0, 48),
    after=st.integers(1, 32),
    block=st.sampled_from([4 << 10, 64 << 10, 256 << 10]),
)
def test_any_pair_failure_mid_stream_ends_each_write_once_and_leaves_no_pin(
    backend: str, failure: str, fail_at: int, after: int, block: int
) -> None:
    factory = PairFactory(backend)
    closed = False
    try:
        pair = factory(SIZE, SIZE, sq_depth=32)
        total = fail_at + after
        wcs = stream_and_fail(pair, failure, fail_at, total, block=block)
        assert_ended_once_in_rc_order(wcs, total)
        assert own_pins(pair.a.mr) == 0, "a pin on the initiator's buffer outlived the stream"
        assert returns(lambda: pair.a.deregister(pair.a.mr)), "deregistering the initiator's buffer hangs"
        assert returns(factory.close), "closing the pair's backends hangs"
        closed = True
        assert own_pins(pair.b.mr) == 0, "a pin on the target's buffer outlived the pair"
    finally:
        if not closed:
            returns(factory.close)
