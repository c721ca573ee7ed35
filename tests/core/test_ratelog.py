from __future__ import annotations

import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

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


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def captured(name: str) -> tuple[logging.Logger, Capture]:
    logger = logging.getLogger(name)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    handler = Capture()
    logger.handlers[:] = [handler]
    return logger, handler


def test_defaults_one_warning_per_ten_seconds_and_1024_keys() -> None:
    logger, out = captured("t.ratelog.defaults")
    clock = Clock()
    clock.now = 500.0  # the window arithmetic must not rely on a clock that starts at 0
    rl = RateLimitedLog(logger, clock=clock)
    assert rl.log("k", "first")
    assert not rl.log("k", "second")
    clock.now = 509.999
    assert not rl.log("k", "third")
    clock.now = 510.0  # exactly one interval after the window opened: a new window
    assert rl.log("k", "fourth")
    assert [(r.levelno, r.getMessage()) for r in out.records] == [
        (logging.WARNING, "first"),
        (logging.WARNING, "fourth (2 similar line(s) held back in the last 10s)"),
    ]
    assert rl.suppressed == 2
    for i in range(1100):
        rl.log(f"key{i}", "x")
    assert rl.tracked_keys == 1024


def test_the_level_and_the_arguments_are_passed_through() -> None:
    logger, out = captured("t.ratelog.level")
    rl = RateLimitedLog(logger, logging.ERROR, clock=Clock())
    assert rl.log("k", "peer %s sent %d bad frames", "10.0.0.9", 3)
    (record,) = out.records
    assert record.levelno == logging.ERROR
    assert record.getMessage() == "peer 10.0.0.9 sent 3 bad frames"
    assert record.args == ("10.0.0.9", 3)


def test_a_burst_lets_that_many_lines_through_per_window() -> None:
    logger, out = captured("t.ratelog.burst")
    clock = Clock()
    rl = RateLimitedLog(logger, interval=2.5, burst=3, clock=clock)
    assert [rl.log("k", "line") for _ in range(5)] == [True, True, True, False, False]
    clock.now = 2.5
    assert [rl.log("k", "line") for _ in range(4)] == [True, True, True, False]
    assert [r.getMessage() for r in out.records] == ["line"] * 3 + [
        "line (2 similar line(s) held back in the last 2.5s)",
        "line",
        "line",
    ]
    assert rl.suppressed == 3


def test_the_least_recently_used_key_is_dropped_and_a_dropped_key_starts_afresh() -> None:
    logger, out = captured("t.ratelog.lru")
    clock = Clock()
    rl = RateLimitedLog(logger, max_keys=2, clock=clock)
    assert rl.log("a", "a1")
    assert rl.log("b", "b1")
    assert not rl.log("a", "a2")  # a is now the most recently used
    assert rl.log("c", "c1")  # drops b, not a
    assert rl.tracked_keys == 2
    assert not rl.log("a", "a3"), "a was dropped instead of the least recently used key"
    assert rl.log("b", "b2"), "b was kept although it was the least recently used key"
    assert [r.getMessage() for r in out.records] == ["a1", "b1", "c1", "b2"]  # b's held count went with it


def test_a_window_opened_by_a_held_line_is_not_reopened_by_it() -> None:
    """The window starts at the line that opened it, not at the latest line: a steady trickle still gets
    one line per interval."""
    logger, out = captured("t.ratelog.trickle")
    clock = Clock()
    rl = RateLimitedLog(logger, interval=10, clock=clock)
    emitted = []
    for step in range(40):
        clock.now = 100.0 + step  # one line a second for 40 s
        emitted.append(rl.log("k", "x"))
    assert [i for i, e in enumerate(emitted) if e] == [0, 10, 20, 30]
    assert [r.getMessage() for r in out.records][1:] == ["x (9 similar line(s) held back in the last 10s)"] * 3


@given(
    events=st.lists(
        st.tuples(st.sampled_from("abc"), st.floats(0, 4, allow_nan=False)),
        max_size=60,
    ),
    interval=st.sampled_from([1.0, 2.5, 3.0]),
    burst=st.integers(1, 3),
    max_keys=st.integers(1, 3),
)
def test_matches_a_reference_model(events: list[tuple[str, float]], interval: float, burst: int, max_keys: int) -> None:
    logger, out = captured("t.ratelog.model")
    clock = Clock()
    rl = RateLimitedLog(logger, interval=interval, burst=burst, max_keys=max_keys, clock=clock)
    windows: dict[str, list[float]] = {}  # insertion order = recency
    expected: list[str] = []
    suppressed = 0
    now = 0.0
    for key, dt in events:
        now += dt
        clock.now = now
        w = windows.pop(key, None)
        held = 0
        if w is None or now - w[0] >= interval:
            held = int(w[2]) if w else 0
            w = [now, 0, 0]
        windows[key] = w
        if len(windows) > max_keys:
            del windows[next(iter(windows))]
        if w[1] >= burst:
            w[2] += 1
            suppressed += 1
            assert not rl.log(key, key)
            continue
        w[1] += 1
        assert rl.log(key, key)
        expected.append(key if not held else f"{key} ({held} similar line(s) held back in the last {interval:g}s)")
    assert [r.getMessage() for r in out.records] == expected
    assert rl.suppressed == suppressed
    assert rl.tracked_keys == len(windows)


def test_a_key_whose_window_was_renewed_counts_as_recently_used() -> None:
    """Found by the reference model: assigning a known key in an OrderedDict keeps its old place, so a key
    that had just opened a new window was dropped before keys unused since."""
    logger, out = captured("t.ratelog.renewed")
    clock = Clock()
    rl = RateLimitedLog(logger, interval=10, max_keys=2, clock=clock)
    assert rl.log("a", "a1")
    assert rl.log("b", "b1")
    clock.now = 10.0
    assert rl.log("a", "a2")  # a opens its second window: the most recently used key
    assert rl.log("c", "c1")  # drops b
    assert not rl.log("a", "a3"), "a was dropped although b was the least recently used key"
    assert [r.getMessage() for r in out.records] == ["a1", "b1", "a2", "c1"]


def test_rotating_keys_share_one_global_budget_then_a_summary_line() -> None:
    """Issue 23: the limit was per key, so 2,000 bad frames from 2,000 addresses gave 2,000 lines. Every key
    also shares ``global_burst`` lines per interval; the first call after that window says how many more
    were suppressed."""
    logger, out = captured("t.ratelog.global")
    clock = Clock()
    rl = RateLimitedLog(logger, interval=10, global_burst=5, clock=clock)
    emitted = [rl.log(f"10.0.{i >> 8}.{i & 0xFF}", "bad frame from %s", str(i)) for i in range(2000)]
    assert sum(emitted) == 5 and emitted[:5] == [True] * 5
    assert rl.suppressed == 1995
    clock.now = 10.0
    assert rl.log("10.9.9.9", "bad frame from %s", "late")
    lines = [r.getMessage() for r in out.records]
    assert lines[:5] == [f"bad frame from {i}" for i in range(5)]
    assert lines[5:] == [
        "1995 more line(s) suppressed in the last 10s (over 5 lines from all sources)",
        "bad frame from late",
    ]


def test_the_default_global_budget_holds_a_thousand_keys_to_twenty_lines() -> None:
    logger, out = captured("t.ratelog.global.default")
    rl = RateLimitedLog(logger, clock=Clock())
    assert sum(rl.log(f"k{i}", "x") for i in range(1000)) == 20
    assert len(out.records) == 20
