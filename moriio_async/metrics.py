"""``EngineCollector``: an engine's ``statistics()`` as Prometheus metrics, read at scrape time.

Needs ``prometheus-client`` (``pip install 'moriio-async[serving]'``); nothing
else in moriio_async imports this module, so the runtime does not depend on it::

    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))   # then serve generate_latest(registry) at /metrics

Every figure of ``EngineStatistics.figures()`` is exported as
``<prefix>_<name>`` (``moriio_engine_outstanding``, ``moriio_engine_bad_frames_total``,
``moriio_engine_reader_completions_total``, ``moriio_engine_data_plane_<counter>_total``). Counts that
only grow are counters (``_total``), the rest gauges. Access errors carry a
``peer`` label, the transports chosen per peer a ``peer`` and a ``transport``
label (value 1). A closed engine still reports its last figures; one that
raises exports nothing for that scrape, never a failed scrape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .engine import EngineStatistics, IOEngine

__all__ = ["GAUGES", "EngineCollector"]

GAUGES = frozenset({
    "authenticated", "sessions", "regions", "uids_in_flight", "outstanding", "channels", "reader_largest_batch",
    "reader_fallback_polling", "peers", "links", "answering_qps", "opened_qps", "inbound_notifications",
    "inbound_notification_bytes", "inbound_statuses", "inbound_status_bytes",
})  # fmt: skip
"""Levels, which go down as well as up; every other figure only grows (a counter)."""


class EngineCollector(Collector):
    """Exports ``engine.statistics()`` at every scrape (register it with a ``CollectorRegistry``)."""

    def __init__(self, engine: IOEngine, prefix: str = "moriio_engine") -> None:
        self._read: Callable[[], EngineStatistics] = engine.statistics
        self.prefix = prefix

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._read()
        except Exception:  # an engine that cannot answer: nothing to export, never a failed scrape
            return
        doc = "IOEngine.statistics()"
        for name, value in stats.figures().items():
            family = GaugeMetricFamily if name in GAUGES else CounterMetricFamily
            yield family(f"{self.prefix}_{name}", doc, value=value)
        errors = CounterMetricFamily(f"{self.prefix}_access_errors", doc, labels=["peer"])
        for peer, n in stats.guard.access_errors.items():
            errors.add_metric([peer], n)
        yield errors
        chosen = GaugeMetricFamily(f"{self.prefix}_peer_transport", doc, labels=["peer", "transport", "side"])
        for side, table in (("initiator", stats.peer_transports), ("target", stats.answering_transports)):
            for peer, transport in table.items():
                chosen.add_metric([peer, transport, side], 1)
        yield chosen
