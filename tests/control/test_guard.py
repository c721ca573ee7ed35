"""The guard's counters and lines: what a hostile peer can make an engine log or count is bounded."""

from __future__ import annotations

import logging

import pytest

from moriio_async.control.guard import MAX_TRACKED_PEERS, Guard


def test_lines_are_rate_limited_per_address_and_counters_are_exact(caplog: pytest.LogCaptureFixture) -> None:
    guard = Guard(logging.getLogger("moriio_async"), interval=60)
    for i in range(100):
        guard.bad_frame("10.0.0.1", f"10.0.0.1:{i}", ValueError("nested too deeply"))
        guard.rogue_hello("10.0.0.2", f"10.0.0.2:{i}", "bad proof", auth=True, impersonation=i % 2 == 0)
        guard.refused_link("10.0.0.3", "max_links_per_address")
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 3  # one per kind and address in the interval
    assert "impersonation attempt" in lines[1] and "10.0.0.2:0" in lines[1]
    counters = guard.snapshot()
    assert (counters.bad_frames, counters.rogue_hellos, counters.auth_failures) == (100, 100, 100)
    assert (counters.impersonations, counters.refused_links) == (50, 100)
    assert guard.suppressed == 297


def test_access_errors_are_counted_per_peer_and_the_peers_tracked_are_bounded() -> None:
    guard = Guard(logging.getLogger("moriio_async.test"))
    for _ in range(3):
        guard.access_error("prefill-0", "rkey 0x1234 is not exported")
    for i in range(MAX_TRACKED_PEERS + 10):
        guard.access_error(f"guess-{i}", "rkey guess")
    errors = guard.snapshot().access_errors
    assert len(errors) == MAX_TRACKED_PEERS
    assert "prefill-0" not in errors  # the least recently hit peer was dropped first
    guard.access_error("guess-20", "again")
    assert guard.snapshot().access_errors["guess-20"] == 2
