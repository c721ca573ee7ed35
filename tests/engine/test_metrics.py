"""``EngineCollector`` exports a running engine's statistics, and Prometheus' own parser reads them back."""

from __future__ import annotations

import dataclasses

import pytest

from moriio_async import EngineStatistics, IOEngine, IOEngineConfig

from .conftest import make_pair

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from moriio_async.metrics import GAUGES, EngineCollector  # noqa: E402


def scrape(engine: IOEngine) -> dict[str, float]:
    """What ``/metrics`` would show: {'name{label="v",...}': value}, parsed by prometheus_client."""
    registry = prometheus_client.CollectorRegistry()
    registry.register(EngineCollector(engine))
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(prometheus_client.generate_latest(registry).decode()):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


async def test_a_scrape_reports_the_engines_figures_as_they_move() -> None:
    a, b, p = await make_pair("mock")
    try:
        idle = scrape(a)
        await p.session.read(0, 0, 4096)
        await p.session.read(0, 4096, 4096)
        moved = scrape(a)
        stats = a.statistics()
    finally:
        await a.close()
        await b.close()
    assert moved["moriio_engine_sessions"] == idle["moriio_engine_sessions"] == 1
    assert moved["moriio_engine_regions"] == 1
    assert moved["moriio_engine_links"] == stats.peers.links >= 1
    assert moved["moriio_engine_outstanding"] == 0
    assert moved["moriio_engine_authenticated"] == float(stats.authenticated)
    # Counters are exported as counters (Prometheus adds _total), and they count what happened.
    assert moved["moriio_engine_reader_completions_total"] - idle.get("moriio_engine_reader_completions_total", 0) >= 2
    assert moved["moriio_engine_reader_completions_total"] == stats.router.reader.completions
    assert moved['moriio_engine_peer_transport{peer="b",side="initiator",transport="mock"}'] == 1
    assert "moriio_engine_key" not in moved and "moriio_engine_incarnation" not in moved


async def test_the_target_labels_the_transport_each_peers_pairs_use() -> None:
    a, b, p = await make_pair("mock")
    try:
        await p.session.read(0, 0, 4096)
        target = scrape(b)
    finally:
        await a.close()
        await b.close()
    assert target['moriio_engine_peer_transport{peer="a",side="target",transport="mock"}'] == 1
    assert target["moriio_engine_answering_qps"] == 1
    assert not any(name.startswith("moriio_engine_access_errors_total") for name in target)  # none refused


def test_every_figure_of_the_statistics_is_exported_once_under_its_own_name() -> None:
    stats = IOEngine("x", IOEngineConfig(backend="mock")).statistics()  # before start: the idle figures
    names = list(stats.figures())
    scalar = sum(
        1
        for group in (stats, stats.router, stats.router.reader, stats.peers, stats.guard, stats.inbound)
        for f in dataclasses.fields(group)
        if isinstance(getattr(group, f.name), bool | int) and f.name not in ("incarnation",)
    )
    assert len(names) == scalar + len(stats.data_plane)
    assert set(names) >= GAUGES
    assert isinstance(stats, EngineStatistics)
