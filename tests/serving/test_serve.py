"""The official ``openai`` package against ``demo --serve``: streamed, not streamed, concurrent, both modes."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from moriio_async.serving.vllm.client import openai_load
from moriio_async.serving.workload import Result, run_load

from ..control.wire import ENV_SECRET, hello
from .fleet import MODEL, ServedFleet, reference, serve

PROMPTS = ["Hello, world", "Disaggregated serving moves the KV cache", "é ü ß: UTF-8 prompts are bytes", "a" * 150]


@pytest.fixture(scope="module", params=["write", "read"])
def fleet(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedFleet]:
    served = serve(tmp_path_factory.mktemp("serve"), str(request.param))
    try:
        yield served
    finally:
        code, left = served.stop()
        assert code == 130, f"demo --serve exited {code} on Ctrl-C"
        assert left == [], f"instance processes left behind: {left}"


@pytest.fixture
def client(fleet: ServedFleet) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_streamed_and_plain_completions_agree_with_each_other_and_the_reference(
    fleet: ServedFleet, client: openai.OpenAI
) -> None:
    for prompt in PROMPTS:
        plain = client.completions.create(model=MODEL.name, prompt=prompt, max_tokens=12)
        chunks = list(
            client.completions.create(
                model=MODEL.name, prompt=prompt, max_tokens=12, stream=True, stream_options={"include_usage": True}
            )
        )
        streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        expected = reference(prompt, 12)
        assert plain.choices[0].text == streamed == expected
        assert plain.choices[0].finish_reason == "length"
        assert plain.usage is not None and plain.usage.completion_tokens == 12
        assert plain.usage.prompt_tokens == len(prompt.encode()) + 1
        usage = [ch.usage for ch in chunks if ch.usage is not None]
        assert len(usage) == 1 and usage[0].completion_tokens == 12
        assert sum(1 for ch in chunks if ch.choices and ch.choices[0].text) == 12  # one event per token


def test_concurrent_requests(fleet: ServedFleet, client: openai.OpenAI) -> None:
    prompts = [f"request {i}: " + "kv " * (i * 7 % 40) for i in range(16)]

    def one(prompt: str) -> str:
        if len(prompt) % 2:
            return "".join(
                ch.choices[0].text
                for ch in client.completions.create(model=MODEL.name, prompt=prompt, max_tokens=10, stream=True)
                if ch.choices
            )
        return client.completions.create(model=MODEL.name, prompt=prompt, max_tokens=10).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, prompts))
    assert answers == [reference(p, 10) for p in prompts]


def test_models_and_the_kv_transfer_report(fleet: ServedFleet, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL.name]
    done = client.completions.create(model=MODEL.name, prompt="x" * 100, max_tokens=2)
    kv = (done.model_extra or {})["kv_transfer"]
    assert kv["mode"] == fleet.mode and kv["attempts"] == 1
    # 101 tokens = 7 blocks of 16 tokens, K and V, 2 layers, 16 x 64 float32 each.
    assert kv["bytes"] == 7 * 2 * 2 * 16 * 64 * 4
    assert kv["transfer_s"] > 0 and kv["exposed_s"] >= 0


async def test_the_engines_run_with_a_generated_secret_that_serve_prints(fleet: ServedFleet) -> None:
    """Issue 23 item 7: by default the fleet's engines require a secret, generated for the run, and
    ``--serve`` prints it for engines that join: a hello without it is refused, one with it welcomed."""
    async with httpx.AsyncClient(timeout=5) as web:
        instances = (await web.get(f"{fleet.url}/health")).json()["instances"]
        addresses = [(await web.get(f"{i['url']}/health")).json()["engine"]["address"] for i in instances]
    assert len(addresses) == 2
    for address in addresses:
        for without in (None, b"a-secret-that-is-not-the-fleets"):
            refused = await hello(address, "intruder", secret=without, auth=without is not None)
            await refused.close()
            assert (refused.last["op"], refused.last.get("reason")) == ("error", "auth"), refused.replies
    printed = (fleet.log_dir.parent / f"serve-{fleet.mode}.err").read_text()
    if ENV_SECRET is not None:  # the suite runs authenticated: the fleet uses the same secret
        assert "the engines prove the shared secret in $MORIIO_ASYNC_SECRET" in printed, printed
        secret = ENV_SECRET
    else:
        found = re.search(r"to join: export MORIIO_ASYNC_SECRET=(\S+)", printed)
        assert found is not None, printed
        secret = found.group(1).encode()
        assert len(secret) >= 32
    for address in addresses:
        welcomed = await hello(address, "joining", secret=secret)
        await welcomed.close()
        assert welcomed.welcomed, welcomed.replies


def test_bad_requests(fleet: ServedFleet, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        client.completions.create(model="gpt-5", prompt="hi", max_tokens=4)
    assert nf.value.status_code == 404 and nf.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model=MODEL.name, prompt="x" * MODEL.max_model_len, max_tokens=4)
    assert long.value.code == "context_length_exceeded" and long.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as too_many:
        client.completions.create(model=MODEL.name, prompt="hi", max_tokens=MODEL.max_model_len)
    assert too_many.value.code == "context_length_exceeded" and too_many.value.param == "max_tokens"
    for bad in (0, -3):
        with pytest.raises(openai.BadRequestError) as zero:
            client.completions.create(model=MODEL.name, prompt="hi", max_tokens=bad)
        assert zero.value.param == "max_tokens" and "at least 1" in zero.value.message
    with pytest.raises(openai.BadRequestError) as sampled:
        client.completions.create(model=MODEL.name, prompt="hi", max_tokens=4, temperature=0.7)
    assert sampled.value.param == "temperature"


def test_malformed_and_oversized_bodies(fleet: ServedFleet) -> None:
    for body, code in ((b'{"model": "moriio-tiny", "prompt": ', "invalid_json"), (b"[1, 2]", None)):
        resp = httpx.post(f"{fleet.url}/v1/completions", content=body, headers={"content-type": "application/json"})
        assert resp.status_code == 400
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
        assert err["code"] == code
    resp = httpx.post(f"{fleet.url}/v1/completions", content=b" " * (2 << 20))
    assert resp.status_code == 413 and "error" in resp.json()
    resp = httpx.get(f"{fleet.url}/v1/nothing-here")
    assert resp.status_code == 404 and resp.json()["error"]["message"] == "Not Found"


def scrape(url: str) -> dict[str, float]:
    """``/metrics`` as {'name{label="v",...}': value}."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_metrics_present_and_moving(fleet: ServedFleet, client: openai.OpenAI) -> None:
    urls = {i["role"]: i["url"] for i in fleet.instances()}
    mover = urls["prefill"] if fleet.mode == "write" else urls["decode"]  # who posts the transfers
    op = f'{{op="{fleet.mode}"}}'
    before = {u: scrape(u) for u in (*urls.values(), fleet.url)}
    client.completions.create(model=MODEL.name, prompt="y" * 40, max_tokens=3)  # 41 tokens: 3 blocks
    deadline = time.monotonic() + 5
    while True:
        after = {u: scrape(u) for u in (*urls.values(), fleet.url)}
        if all(after[u]["moriio_kv_blocks_allocated"] == 0 for u in urls.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.05)

    def moved(url: str, name: str) -> float:
        return after[url][name] - before[url].get(name, 0.0)

    assert moved(mover, f"moriio_transfers_started_total{op}") == 2  # one batch per layer
    assert moved(mover, f"moriio_transfers_succeeded_total{op}") == 2
    assert moved(mover, f"moriio_transfer_seconds_count{op}") == 2
    assert moved(mover, f"moriio_transfer_bytes_total{op}") == 3 * 2 * 2 * 16 * 64 * 4
    assert (
        after[mover][f"moriio_transfers_failed_total{op}"] == after[mover][f"moriio_transfers_timed_out_total{op}"] == 0
    )
    for url in urls.values():
        m = after[url]
        assert m["moriio_kv_blocks_allocated"] == m["moriio_kv_blocks_in_flight"] == 0
        assert m["moriio_kv_blocks_capacity"] == m["moriio_kv_blocks_free"] > 0
        assert moved(url, 'moriio_requests_total{outcome="ok"}') == 1
        assert m["moriio_requests_in_flight"] == 0
        assert m["moriio_engine_regions"] == 1
    assert after[mover]["moriio_engine_sessions"] >= 1 and after[mover]["moriio_engine_outstanding"] == 0
    assert moved(mover, "moriio_engine_reader_completions_total") >= 1
    assert moved(fleet.url, 'moriio_proxy_requests_total{status="200"}') == 1
    assert moved(fleet.url, "moriio_proxy_ttft_seconds_count") == 1
    assert moved(fleet.url, "moriio_proxy_kv_transfer_seconds_count") == 1


async def test_both_load_clients_record_the_reference_text_and_a_gap_per_later_token(fleet: ServedFleet) -> None:
    # The vLLM demo's client (the openai package) and the numpy demo's (httpx) share Result.add_text.
    prompts = PROMPTS[:2]
    via_openai = await openai_load(f"{fleet.url}/v1", MODEL.name, prompts, 6, 2, 60.0)
    async with httpx.AsyncClient() as web:
        via_httpx = await run_load(web, fleet.url, MODEL.name, prompts, 6, 2, 60.0)
    for results in (via_openai, via_httpx):
        assert [r.text for r in results] == [reference(p, 6) for p in prompts]
        for r in results:
            assert r.ok and r.ttft is not None and len(r.gaps) == 5 and min(r.gaps) >= 0


def test_a_result_times_the_first_piece_and_the_gaps_after_it() -> None:
    res = Result(0, started=10.0)
    for text, now in (("", 10.5), ("he", 11.0), ("", 11.5), ("l", 12.5), ("lo", 12.75)):
        res.add_text(text, now)
    assert (res.text, res.ttft, res.gaps) == ("hello", 1.0, [1.5, 0.25])
