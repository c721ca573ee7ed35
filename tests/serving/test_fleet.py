"""The proxy's view of its instances: who is healthy (the right role and model), and whom it picks."""

from __future__ import annotations

import asyncio
import logging

import httpx
import msgspec
import pytest

from moriio_async.serving.fleet import Fleet
from moriio_async.serving.kvpool import KVLayout
from moriio_async.serving.messages import EndpointInfo, EngineRef, InstanceHealth
from moriio_async.serving.model import ModelConfig

SMALL = ModelConfig(d_model=16, n_layers=2, n_heads=2, d_ff=32, block_size=4, max_model_len=32)
OTHER = ModelConfig(d_model=16, n_layers=2, n_heads=2, d_ff=32, block_size=4, max_model_len=32, seed=1)
PREFILL = ["http://prefill-0", "http://prefill-1"]
DECODE = ["http://decode-0", "http://decode-1"]


def answer(models: dict[str, ModelConfig]) -> httpx.MockTransport:
    """Every instance healthy in its role, serving the model ``models`` names for it (else SMALL)."""

    def health(request: httpx.Request) -> httpx.Response:
        name = request.url.host
        role = "prefill" if name.startswith("prefill") else "decode"
        model = models.get(name, SMALL)
        layout = KVLayout(model.n_layers, 16, model.block_bytes)
        up = InstanceHealth(
            role, name, 1, model.name, model.fingerprint(), EngineRef(name, "127.0.0.1:1", 1), "tcp", layout,
            {"free": 16}, 0, 0,
        )  # fmt: skip
        return httpx.Response(200, content=msgspec.json.encode(up))

    return httpx.MockTransport(health)


async def fleet_of(models: dict[str, ModelConfig] | None = None) -> tuple[Fleet, httpx.AsyncClient]:
    client = httpx.AsyncClient(transport=answer(models or {}))
    fleet = Fleet(PREFILL, DECODE, client, SMALL.fingerprint())
    await fleet.check_all()
    return fleet, client


async def test_an_instance_serving_another_model_is_down_and_never_picked() -> None:
    assert OTHER.fingerprint() != SMALL.fingerprint()
    fleet, client = await fleet_of({"prefill-1": OTHER})
    try:
        wrong = fleet.of("prefill")[1]
        assert not wrong.healthy and OTHER.fingerprint() in wrong.reason
        assert fleet.ready()  # prefill-0 still serves the model
        assert {fleet.pick("prefill", set()) for _ in range(6)} == {fleet.of("prefill")[0]}
    finally:
        await client.aclose()


async def test_pick_takes_the_least_loaded_and_turns_among_equals() -> None:
    fleet, client = await fleet_of()
    try:
        first, second = fleet.of("decode")
        with fleet.using(first):
            assert [fleet.pick("decode", set()) for _ in range(4)] == [second] * 4, "the idle one, every time"
            with fleet.using(second), fleet.using(second):
                assert fleet.pick("decode", set()) is first  # 1 in flight against 2
        assert {fleet.pick("decode", set()) for _ in range(4)} == {first, second}, "ties are taken in turn"
        assert fleet.pick("decode", {first}) is second and fleet.pick("decode", {first, second}) is None
    finally:
        await client.aclose()


async def test_only_a_request_that_ended_well_counts_as_served() -> None:
    fleet, client = await fleet_of()
    try:
        ep = fleet.of("prefill")[0]
        with fleet.using(ep):
            assert ep.in_flight == 1
        with pytest.raises(RuntimeError), fleet.using(ep):
            raise RuntimeError("the leg failed")
        assert (ep.served, ep.in_flight) == (1, 0)
    finally:
        await client.aclose()


def test_a_fleet_needs_both_roles_and_names_instances_without_a_trailing_slash() -> None:
    client = httpx.AsyncClient()
    for prefill, decode in (([], DECODE), (PREFILL, []), ([], [])):
        with pytest.raises(ValueError, match=r"^a fleet needs at least one prefill and one decode instance$"):
            Fleet(prefill, decode, client, SMALL.fingerprint())
    fleet = Fleet(["http://pX/"], ["http://dX//"], client, SMALL.fingerprint())
    assert [(e.url, e.role) for e in fleet.endpoints] == [("http://pX", "prefill"), ("http://dX", "decode")]
    assert not fleet.ready() and all(e.reason == "not checked yet" for e in fleet.endpoints)


async def test_an_instance_is_down_until_it_answers_well_and_a_bad_answer_says_why() -> None:
    answers: dict[str, httpx.Response] = {}
    timeouts: list[object] = []
    good = answer({})

    def handler(request: httpx.Request) -> httpx.Response:
        timeouts.append(request.extensions["timeout"])
        return answers.get(request.url.host) or good.handle_request(request)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        fleet = Fleet(PREFILL, DECODE, client, SMALL.fingerprint(), interval=0.75)
        await fleet.check_all()
        assert fleet.ready() and all(e.healthy and e.reason == "ok" for e in fleet.endpoints)
        assert timeouts[0] == {"connect": 1.5, "read": 1.5, "write": 1.5, "pool": 1.5}  # twice the interval
        p0, p1 = fleet.of("prefill")
        d0, d1 = fleet.of("decode")
        answers["prefill-0"] = httpx.Response(500, content=b"{}")
        answers["prefill-1"] = httpx.Response(200, content=b"not json")
        answers["decode-0"] = good.handle_request(httpx.Request("GET", "http://prefill-9/health"))  # a prefill
        await fleet.check_all()
        assert not p0.healthy and p0.reason.startswith("health check failed: HTTPStatusError: ")
        assert not p1.healthy and p1.reason.startswith("health check failed: DecodeError: ")
        assert not d0.healthy and d0.reason == f"it serves prefill of model {SMALL.name} ({SMALL.fingerprint()})"
        assert d1.healthy and not fleet.ready()
        answers.clear()
        await fleet.check_all()
        assert fleet.ready() and all(e.healthy for e in fleet.endpoints)


async def test_a_short_interval_still_gives_a_health_check_a_second() -> None:
    timeouts: list[object] = []
    good = answer({})

    def handler(request: httpx.Request) -> httpx.Response:
        timeouts.append(request.extensions["timeout"]["read"])
        return good.handle_request(request)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        await Fleet(PREFILL, DECODE, client, SMALL.fingerprint(), interval=0.1).check_all()
        await Fleet(PREFILL, DECODE, client, SMALL.fingerprint()).check_all()  # every half second by default
    assert timeouts == [1.0] * 8


async def test_the_fleet_polls_every_interval_until_closed() -> None:
    calls: list[str] = []
    three_rounds = asyncio.Event()
    good = answer({})

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.host)
        if len(calls) >= 12:
            three_rounds.set()
        return good.handle_request(request)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        fleet = Fleet(PREFILL, DECODE, client, SMALL.fingerprint(), interval=0.01)
        await fleet.close()  # never started: nothing to stop
        await fleet.start()
        assert len(calls) == 4 and fleet.ready()  # start checks every instance before it returns
        assert "fleet health" in {t.get_name() for t in asyncio.all_tasks()}  # named in a dump of the tasks
        await asyncio.wait_for(three_rounds.wait(), 10)
        await fleet.close()
        polled = len(calls)
        await asyncio.sleep(0.05)
        assert len(calls) == polled, "no probe after close"


async def test_describe_shows_the_instances_own_figures_once_it_answered() -> None:
    fleet, client = await fleet_of()
    try:
        ep = fleet.of("decode")[1]
        with fleet.using(ep):
            info = ep.describe()
        assert info == EndpointInfo(
            url="http://decode-1", role="decode", healthy=True, reason="ok", name="decode-1", pid=1,
            incarnation=1, in_flight=1, served=0,
        )  # fmt: skip
        fresh = Fleet(PREFILL, DECODE, client, SMALL.fingerprint()).endpoints[0].describe()
        assert (fresh.name, fresh.pid, fresh.incarnation, fresh.healthy) == (None, None, None, False)
    finally:
        await client.aclose()


async def test_a_restart_or_an_outage_is_logged_once_with_the_new_incarnation(caplog: pytest.LogCaptureFixture) -> None:
    incarnation = {"n": 1}
    down = {"now": False}

    def handler(request: httpx.Request) -> httpx.Response:
        if down["now"]:
            return httpx.Response(503)
        model = SMALL
        name = request.url.host
        role = "prefill" if name.startswith("prefill") else "decode"
        up = InstanceHealth(
            role, name, 1, model.name, model.fingerprint(), EngineRef(name, "127.0.0.1:1", incarnation["n"]), "tcp",
            KVLayout(model.n_layers, 16, model.block_bytes), {"free": 16}, 0, 0,
        )  # fmt: skip
        return httpx.Response(200, content=msgspec.json.encode(up))

    caplog.set_level(logging.INFO, logger="moriio_async.serving")
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        fleet = Fleet(PREFILL[:1], DECODE[:1], client, SMALL.fingerprint())
        await fleet.check_all()
        await fleet.check_all()
        assert [r.getMessage() for r in caplog.records] == ["prefill http://prefill-0 is up (prefill-0)",
                                                            "decode http://decode-0 is up (decode-0)"]  # fmt: skip
        caplog.clear()
        incarnation["n"] = 0x2A
        await fleet.check_all()
        assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
            (logging.WARNING, "prefill http://prefill-0 restarted: incarnation 0x2a"),
            (logging.WARNING, "decode http://decode-0 restarted: incarnation 0x2a"),
        ]
        caplog.clear()
        down["now"] = True
        await fleet.check_all()
        await fleet.check_all()
        downs = [r.getMessage() for r in caplog.records]
        assert len(downs) == 2 and downs[0].startswith("prefill http://prefill-0 is down: health check failed")
        assert all(r.levelno == logging.WARNING for r in caplog.records)
