"""Prometheus metrics of one serving process, served at ``/metrics``.

Each process owns a ``CollectorRegistry`` (not the global one, so tests can build
several apps in one interpreter). Counters and the latency histogram are updated
where transfers start and end; block counts and the engine's ``statistics()``
are read at scrape time by a collector, so they are never stale.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from moriio_async import Transfer, TransferError

__all__ = ["CONTENT_TYPE", "InstanceMetrics", "ProxyMetrics", "StatsCollector"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


def _flatten(prefix: str, value: object) -> Iterator[tuple[str, float]]:
    if isinstance(value, bool | int | float):
        yield prefix, float(value)
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _flatten(f"{prefix}_{k}", v)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        yield from _flatten(prefix, dataclasses.asdict(value))


class StatsCollector(Collector):
    """Exports every number in ``read()``'s (nested) dict as a gauge named ``prefix_key``."""

    def __init__(self, prefix: str, doc: str, read: Callable[[], Mapping[str, object]]) -> None:
        self.prefix, self.doc, self.read = prefix, doc, read

    def collect(self) -> Iterable[GaugeMetricFamily]:
        try:
            stats = self.read()
        except Exception:  # a closed engine or pool: nothing to export, never a failed scrape
            return
        for name, value in _flatten(self.prefix, stats):
            yield GaugeMetricFamily(name, self.doc, value=value)


class InstanceMetrics:
    """Transfer and request metrics of a prefill or decode instance."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.started = Counter("moriio_transfers_started", "KV transfers posted", ["op"], registry=r)
        self.succeeded = Counter("moriio_transfers_succeeded", "KV transfers that succeeded", ["op"], registry=r)
        self.failed = Counter("moriio_transfers_failed", "KV transfers that failed", ["op"], registry=r)
        self.timed_out = Counter("moriio_transfers_timed_out", "KV transfers past their deadline", ["op"], registry=r)
        self.bytes = Counter("moriio_transfer_bytes", "KV bytes moved by succeeded transfers", ["op"], registry=r)
        self.latency = Histogram(
            "moriio_transfer_seconds",
            "Post-to-completion time of succeeded transfers",
            ["op"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.requests_in_flight = Gauge("moriio_requests_in_flight", "Requests being served", registry=r)
        self.requests = Counter("moriio_requests", "Requests ended, by outcome", ["outcome"], registry=r)

    def watch(self, op: str, transfers: Iterable[Transfer]) -> None:
        """Count transfers as started; each one's latency and bytes are recorded when it succeeds."""
        posted = time.perf_counter()

        def ended(t: Transfer) -> None:
            if t.Succeeded():
                self.latency.labels(op).observe(time.perf_counter() - posted)
                self.bytes.labels(op).inc(t.nbytes)

        n = 0
        for t in transfers:
            t.add_done_callback(ended)
            n += 1
        self.started.labels(op).inc(n)

    def settle(self, op: str, transfers: Iterable[Transfer], error: TransferError | None) -> None:
        """Count a wait's outcome: each transfer exactly once, as succeeded, failed or timed out."""
        items = list(transfers)
        timed_out = len(error.timed_out) if error is not None else 0
        failed = len(error.failed) if error is not None else 0
        self.timed_out.labels(op).inc(timed_out)
        self.failed.labels(op).inc(failed)
        self.succeeded.labels(op).inc(len(items) - timed_out - failed)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ProxyMetrics:
    """Request metrics of the proxy."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.requests = Counter(
            "moriio_proxy_requests", "Completions requests ended, by HTTP status", ["status"], registry=r
        )
        self.requests_in_flight = Gauge("moriio_proxy_requests_in_flight", "Completions being served", registry=r)
        self.retries = Counter("moriio_proxy_retries", "Attempts retried on other instances", ["reason"], registry=r)
        self.ttft = Histogram(
            "moriio_proxy_ttft_seconds",
            "Time to the first token, as the proxy sees it",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.kv_transfer = Histogram(
            "moriio_proxy_kv_transfer_seconds",
            "KV transfer time on the TTFT path",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
