"""KV transfer figures of a vLLM run, from the compat engines' transfer traces (``MORIIO_ASYNC_TRACE``).

The servers are vLLM's code, so the demo cannot time their transfers itself:
each compat engine inside them writes a line per ended transfer
(:mod:`moriio_async.compat.mori.trace`), on the host's monotonic clock, which is
also the clock of the demo's client (``time.perf_counter`` is
``CLOCK_MONOTONIC`` on Linux). A request's KV time is the time some KV transfer
was in flight inside its TTFT window: with requests running concurrently this
counts other requests' transfers too, so it is an upper bound.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Span", "TraceSummary", "covered", "load_spans"]


@dataclass(frozen=True, slots=True)
class Span:
    t0: float
    t1: float
    nbytes: int
    op: str
    code: int
    transport: str
    engine: str


def load_spans(folder: Path, since: float = 0.0) -> list[Span]:
    """Every transfer traced in ``folder`` that began at or after ``since``, in start order."""
    spans = []
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                d = json.loads(line)
            except ValueError:
                continue  # a line being written right now
            if d["t0"] >= since:
                spans.append(Span(d["t0"], d["t1"], d["bytes"], d["op"], d["code"], d["transport"], d["engine"]))
    return sorted(spans, key=lambda s: s.t0)


def _merged(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def covered(spans: Sequence[Span], start: float, end: float) -> float:
    """Seconds of ``[start, end]`` during which at least one of ``spans`` was in flight."""
    total = 0.0
    for a, b in _merged((s.t0, s.t1) for s in spans if s.t1 > start and s.t0 < end):
        total += min(b, end) - max(a, start)
    return total


@dataclass(frozen=True, slots=True)
class TraceSummary:
    """What a run's transfer spans add up to (``of``)."""

    transfers: int
    failed: int
    """Of the transfers, those that ended with a failure code."""
    nbytes: int
    """Bytes the successful transfers moved."""
    busy: float
    """Seconds during which at least one successful transfer was in flight."""
    transports: frozenset[str]
    """The backends the transfers ran on."""

    @classmethod
    def of(cls, spans: Sequence[Span]) -> TraceSummary:
        ok = [s for s in spans if s.code == 0]
        busy = sum(b - a for a, b in _merged((s.t0, s.t1) for s in ok))
        return cls(
            len(spans), len(spans) - len(ok), sum(s.nbytes for s in ok), busy, frozenset(s.transport for s in spans)
        )
