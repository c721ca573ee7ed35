"""The proxy's view of its instances: who is healthy (the right role and model), and whom it picks."""

from __future__ import annotations

import httpx
import msgspec
import pytest

from moriio_async.serving.fleet import Fleet
from moriio_async.serving.kvpool import KVLayout
from moriio_async.serving.messages import EngineRef, InstanceHealth
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
