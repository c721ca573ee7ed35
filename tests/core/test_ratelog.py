from __future__ import annotations

import logging

import pytest

from moriio_async.core.ratelog import RateLimitedLog


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_one_line_per_key_per_interval_then_a_count_of_what_was_held(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    rl = RateLimitedLog(logging.getLogger("t.ratelog"), interval=10, clock=clock)
    with caplog.at_level(logging.WARNING, "t.ratelog"):
        assert rl.log("10.0.0.1", "bad frame from %s", "10.0.0.1")
        assert not any(rl.log("10.0.0.1", "bad frame from %s", "10.0.0.1") for _ in range(999))
        assert rl.log("10.0.0.2", "bad frame from %s", "10.0.0.2")  # another key has its own budget
        clock.now = 10.0
        assert rl.log("10.0.0.1", "bad frame from %s", "10.0.0.1")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "bad frame from 10.0.0.1",
        "bad frame from 10.0.0.2",
        "bad frame from 10.0.0.1 (999 similar line(s) held back in the last 10s)",
    ]
    assert rl.suppressed == 999


def test_keys_are_bounded() -> None:
    rl = RateLimitedLog(logging.getLogger("t.ratelog2"), max_keys=8, clock=Clock())
    for i in range(1000):
        rl.log(f"k{i}", "x")
    assert rl.tracked_keys == 8
