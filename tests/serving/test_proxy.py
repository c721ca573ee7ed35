"""The proxy's retry rule, against instances faked with ``httpx.MockTransport``: a leg that fails for a reason
another instance would share (a non-retryable 4xx) ends the request at once with a 502; a retryable failure
is tried once more elsewhere, and counted."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import msgspec
import pytest
from fastapi import FastAPI
from starlette.types import Message

from moriio_async.serving.api import ApiError, CompletionRequest
from moriio_async.serving.config import InstanceSettings, ProxySettings
from moriio_async.serving.decode import create_decode_app
from moriio_async.serving.kvpool import KVLayout
from moriio_async.serving.messages import (
    AbortRequest,
    EngineRef,
    ErrorBody,
    InstanceHealth,
    PrefillResponse,
    TokenLine,
    TransferStats,
)
from moriio_async.serving.model import Model, ModelConfig, decode_text, encode
from moriio_async.serving.prefill import create_prefill_app
from moriio_async.serving.proxy import Proxy, create_proxy_app

SMALL = ModelConfig(d_model=16, n_layers=2, n_heads=2, d_ff=32, block_size=4, max_model_len=32)
PREFILL = ["http://prefill-0", "http://prefill-1"]
DECODE = ["http://decode-0", "http://decode-1"]
LAYOUT = KVLayout(SMALL.n_layers, 16, SMALL.block_bytes)


def health(url: str) -> bytes:
    role = "prefill" if "prefill" in url else "decode"
    name = url.removeprefix("http://")
    ref = EngineRef(name, "127.0.0.1:1", 1)
    up = InstanceHealth(role, name, 1, SMALL.name, SMALL.fingerprint(), ref, "tcp", LAYOUT, {"free": 16}, 0, 0)
    return msgspec.json.encode(up)


class Fake:
    """Healthy instances whose ``/prefill`` or ``/generate`` answers what the test says; counts each call."""

    def __init__(self, fail: str, status: int, body: bytes) -> None:
        self.fail, self.status, self.body = fail, status, body
        self.calls: Counter[str] = Counter()
        self.aborts: list[tuple[str, AbortRequest, object]] = []
        self.abort_error: httpx.HTTPError | None = None

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.calls[path] += 1
        if path == "/abort":
            self.aborts.append(
                (
                    request.url.host,
                    msgspec.json.decode(request.content, type=AbortRequest),
                    request.extensions["timeout"],
                )
            )
            if self.abort_error is not None:
                raise self.abort_error
        if path == "/health":
            return httpx.Response(200, content=health(str(request.url).removesuffix("/health")))
        if path == self.fail:
            return httpx.Response(self.status, content=self.body)
        if path == "/prefill":
            ref = EngineRef(request.url.host, "127.0.0.1:1", 1)
            done = PrefillResponse("r", 9, TransferStats(), ref, [0, 1], LAYOUT)
            return httpx.Response(200, content=msgspec.json.encode(done))
        return httpx.Response(200, json={"ok": True})  # /abort


def error(retryable: bool, cause: str = "") -> bytes:
    return msgspec.json.encode(ErrorBody("refused", retryable=retryable, cause=cause))


async def run(fake: Fake, mode: str) -> tuple[ApiError, float]:
    async with httpx.AsyncClient(transport=httpx.MockTransport(fake)) as client:
        settings = ProxySettings(PREFILL, DECODE, SMALL, mode=mode, max_attempts=3)  # type: ignore[arg-type]
        proxy = Proxy(settings, client)
        await proxy.fleet.check_all()
        assert proxy.fleet.ready()
        with pytest.raises(ApiError) as info:
            await proxy.open([1, 2, 3, 4, 5], 2, "cmpl-1")
        retries = sum(s.value for m in proxy.metrics.retries.collect() for s in m.samples if s.name.endswith("_total"))
        return info.value, retries


@pytest.mark.parametrize(
    ("mode", "leg", "status", "body"),
    [
        pytest.param("read", "/prefill", 400, error(False), id="prefill-400-error-body"),
        pytest.param("read", "/prefill", 404, b"not found", id="prefill-404-plain"),
        pytest.param("read", "/generate", 400, error(False), id="decode-400-error-body"),
        pytest.param("read", "/generate", 409, b"conflict", id="decode-409-plain"),
        pytest.param("write", "/prefill", 422, b"unprocessable", id="write-prefill-422-plain"),
    ],
)
async def test_a_non_retryable_4xx_gives_one_attempt_and_a_502(mode: str, leg: str, status: int, body: bytes) -> None:
    fake = Fake(leg, status, body)
    err, retries = await run(fake, mode)
    assert err.status == 502 and "the request failed" in str(err) and err.type == "server_error"
    assert fake.calls[leg] == 1  # one attempt: no other instance was asked
    assert retries == 0


@pytest.mark.parametrize("body", [error(True, "prefill"), b"unavailable"], ids=["error-body", "plain"])
async def test_a_retryable_failure_is_tried_on_another_instance_and_counted(body: bytes) -> None:
    fake = Fake("/prefill", 503, body)
    err, retries = await run(fake, "read")
    assert err.status == 503  # both prefill instances refused: nobody left
    assert fake.calls["/prefill"] == 2 and retries == 2


# -- a whole fleet in one process: the apps behind an ASGI transport -------------------------------


class Apps(httpx.AsyncBaseTransport):
    """Routes a request to the ASGI app named by its host (``http://prefill-0`` and so on)."""

    def __init__(self, apps: dict[str, FastAPI]) -> None:
        self.transports = {host: httpx.ASGITransport(app=app) for host, app in apps.items()}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.transports[request.url.host].handle_async_request(request)


@dataclass
class InProcess:
    proxy: httpx.AsyncClient
    """The proxy app's client."""
    apps: dict[str, FastAPI]
    instances: httpx.AsyncClient
    """A client of the instances' apps, by URL."""


@contextlib.asynccontextmanager
async def in_process(mode: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[InProcess]:
    """One prefill and one decode instance app, and the proxy app, all in this process and loop."""
    apps = {
        f"{role}-0": (create_prefill_app if role == "prefill" else create_decode_app)(
            InstanceSettings(f"{role}-0", role, SMALL, 16, backend="mock")
        )
        for role in ("prefill", "decode")
    }
    instances = httpx.AsyncClient(transport=Apps(apps))
    client_class = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **_kw: client_class(transport=Apps(apps)))
    settings = ProxySettings(["http://prefill-0"], ["http://decode-0"], SMALL, mode=mode)  # type: ignore[arg-type]
    proxy_app = create_proxy_app(settings)
    async with contextlib.AsyncExitStack() as stack:
        for app in apps.values():
            await stack.enter_async_context(app.router.lifespan_context(app))
        await stack.enter_async_context(proxy_app.router.lifespan_context(proxy_app))
        monkeypatch.undo()
        proxy = await stack.enter_async_context(
            httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy_app), base_url="http://proxy")
        )
        await stack.enter_async_context(instances)
        yield InProcess(proxy, apps, instances)


def reference(prompt: str, max_tokens: int) -> str:
    return decode_text(Model(SMALL).generate(encode(prompt), max_tokens))


async def pools_whole(fleet: InProcess) -> None:
    for url in ("http://prefill-0", "http://decode-0"):
        health = msgspec.json.decode((await fleet.instances.get(f"{url}/health")).content, type=InstanceHealth)
        assert health.blocks["free"] == 16 and health.blocks["in_flight"] == 0, health
        assert health.requests_in_flight == 0


@pytest.mark.parametrize("mode", ["read", "write"])
async def test_a_completion_through_the_proxy_is_the_reference_and_reports_its_kv_transfer(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with in_process(mode, monkeypatch) as fleet:
        body = {"model": SMALL.name, "prompt": "hello there", "max_tokens": 5}
        resp = await fleet.proxy.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        answer = resp.json()
        assert answer["choices"][0]["text"] == reference("hello there", 5)
        assert answer["choices"][0]["finish_reason"] == "length" and answer["model"] == SMALL.name
        assert answer["usage"] == {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}
        kv = answer["kv_transfer"]
        blocks = SMALL.blocks_for(12)
        assert (kv["attempts"], kv["mode"], kv["prefill"], kv["decode"]) == (
            1, mode, "http://prefill-0", "http://decode-0"
        )  # fmt: skip
        assert kv["bytes"] == SMALL.n_layers * 2 * blocks * SMALL.block_bytes
        assert kv["transfer_s"] > 0 and kv["prefill_compute_s"] > 0
        assert 0 <= kv["exposed_s"] < 60  # a duration, not a clock reading
        await pools_whole(fleet)


@pytest.mark.parametrize("mode", ["read", "write"])
async def test_a_streamed_completion_is_the_reference_chunk_by_chunk_then_usage_and_done(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with in_process(mode, monkeypatch) as fleet:
        body = {
            "model": SMALL.name, "prompt": "stream", "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True},
        }  # fmt: skip
        resp = await fleet.proxy.post("/v1/completions", json=body)
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = [e.removeprefix("data: ") for e in resp.text.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        chunks = [msgspec.json.decode(e) for e in events[:-1]]
        texts = [c["choices"][0]["text"] for c in chunks[:4]]
        assert "".join(texts) == reference("stream", 4) and all(len(t) == 1 for t in texts)
        last, usage = chunks[4], chunks[5]
        assert last["choices"][0]["finish_reason"] == "length" and last["kv_transfer"]["mode"] == mode
        assert usage["usage"] == {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}
        assert len(chunks) == 6 and len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
        assert {(c["model"], c["created"]) for c in chunks} == {(SMALL.name, chunks[0]["created"])}
        assert isinstance(chunks[0]["created"], int)
        assert last["choices"][0]["text"] == "" and usage["choices"] == []
        await pools_whole(fleet)


async def test_the_proxy_lists_its_model_and_its_instances_and_counts_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = int(time.time())
    async with in_process("write", monkeypatch) as fleet:
        models = (await fleet.proxy.get("/v1/models")).json()
        assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [(SMALL.name, SMALL.max_model_len)]
        assert before <= models["data"][0]["created"] <= time.time()  # when the proxy started
        openapi = (await fleet.proxy.get("/openapi.json")).json()
        assert openapi["info"]["title"] == "moriio_async disaggregated serving proxy"
        health = await fleet.proxy.get("/health")
        assert health.status_code == 200 and health.json()["ready"] is True and health.json()["mode"] == "write"
        assert [(i["url"], i["healthy"]) for i in health.json()["instances"]] == [
            ("http://prefill-0", True), ("http://decode-0", True)
        ]  # fmt: skip
        bad = await fleet.proxy.post("/v1/completions", json={"model": "other", "prompt": "x"})
        assert bad.status_code == 404 and bad.json()["error"]["code"] == "model_not_found"
        ok = await fleet.proxy.post("/v1/completions", json={"model": SMALL.name, "prompt": "x", "max_tokens": 1})
        assert ok.status_code == 200
        metrics = (await fleet.proxy.get("/metrics")).text
        assert 'status="404"} 1.0' in metrics and 'status="200"} 1.0' in metrics
        assert "requests_in_flight 0.0" in metrics
        served = {i["url"]: i["served"] for i in (await fleet.proxy.get("/health")).json()["instances"]}
        assert served == {"http://prefill-0": 1, "http://decode-0": 1}


async def test_an_instance_app_answers_serving_errors_as_an_error_body(monkeypatch: pytest.MonkeyPatch) -> None:
    async with in_process("write", monkeypatch) as fleet:
        bad = await fleet.instances.post("http://decode-0/generate", content=b"{}")
        assert bad.status_code == 400 and msgspec.json.decode(bad.content, type=ErrorBody).error.startswith(
            "bad GenerateRequest"
        )
        bad = await fleet.instances.post("http://prefill-0/prefill", content=b"[1]")
        assert bad.status_code == 400 and "bad PrefillRequest" in bad.json()["error"]
        ok = await fleet.instances.post("http://prefill-0/abort", content=msgspec.json.encode(AbortRequest("x")))
        assert ok.status_code == 200 and ok.json() == {"ok": True}
        assert (await fleet.instances.get("http://decode-0/metrics")).status_code == 200


@pytest.mark.parametrize("abort_fails", [False, True], ids=["abort-answered", "abort-unreachable"])
async def test_a_failed_decode_leg_tells_the_prefill_instance_to_give_up_on_its_lent_blocks(abort_fails: bool) -> None:
    """READ mode: prefill lent its blocks, decode refused the request: prefill hears /abort for that request id,
    bounded by the leg's deadlines; an abort that cannot be delivered does not change the answer."""
    fake = Fake("/generate", 400, error(False))
    if abort_fails:
        fake.abort_error = httpx.ConnectError("refused")
    err, _ = await run(fake, "read")
    assert err.status == 502
    settings = ProxySettings(PREFILL, DECODE, SMALL)
    timeout = {"connect": settings.control_timeout, "read": settings.leg_timeout}
    timeout |= {"write": settings.leg_timeout, "pool": settings.leg_timeout}
    assert len(fake.aborts) == 1
    host, body, sent_timeout = fake.aborts[0]
    assert host.startswith("prefill-") and body == AbortRequest("cmpl-1-0") and sent_timeout == timeout


def test_a_request_must_name_the_model_and_fit_in_its_context() -> None:
    proxy = Proxy(ProxySettings(PREFILL, DECODE, SMALL), httpx.AsyncClient())
    prompt = "x" * 10  # 11 tokens with BOS
    assert proxy.check(CompletionRequest(model=SMALL.name, prompt=prompt, max_tokens=None)) == (encode(prompt), 16)
    assert proxy.check(CompletionRequest(model=SMALL.name, prompt=prompt, max_tokens=21))[1] == 21  # 32 exactly
    with pytest.raises(ApiError) as info:
        proxy.check(CompletionRequest(model="gpt", prompt=prompt))
    err = info.value
    assert (err.status, err.param, err.code, str(err)) == (
        404,
        "model",
        "model_not_found",
        "The model `gpt` does not exist.",
    )
    with pytest.raises(ApiError) as info:
        proxy.check(CompletionRequest(model=SMALL.name, prompt=prompt, max_tokens=22))
    err = info.value
    assert (err.status, err.param, err.code) == (400, "max_tokens", "context_length_exceeded")
    assert str(err) == (
        "This model's maximum context length is 32 tokens. However, you requested 33 tokens "
        "(11 in the prompt, 22 in the completion)."
    )
    for prompt in ("y" * 31, "y" * 40):  # the prompt alone fills the context: it is the prompt's fault
        with pytest.raises(ApiError) as info:
            proxy.check(CompletionRequest(model=SMALL.name, prompt=prompt, max_tokens=1))
        assert info.value.param == "prompt"
    with pytest.raises(ApiError) as info:
        proxy.check(CompletionRequest(model=SMALL.name, prompt="y" * 30, max_tokens=2))
    assert info.value.param == "max_tokens"


async def open_with(handler: httpx.MockTransport, mode: str = "read") -> tuple[Proxy, ApiError, Counter[str]]:
    """``Proxy.open`` over instances answered by ``handler``: the error it ends with, and retries by blamed role."""
    async with httpx.AsyncClient(transport=handler) as client:
        proxy = Proxy(ProxySettings(PREFILL, DECODE, SMALL, mode=mode, max_attempts=3), client)  # type: ignore[arg-type]
        await proxy.fleet.check_all()
        with pytest.raises(ApiError) as info:
            await proxy.open([1, 2, 3, 4, 5], 2, "cmpl-1")
        retries = Counter(
            {
                s.labels["reason"]: s.value
                for m in proxy.metrics.retries.collect()
                for s in m.samples
                if s.name.endswith("_total")
            }
        )
        return proxy, info.value, retries


async def test_a_retryable_failure_blames_the_instance_its_error_names(caplog: pytest.LogCaptureFixture) -> None:
    """Prefill refuses because of decode (``cause``): the decode instance is left out, not the prefill one;
    each failed attempt is logged with its number, the completion's id and its cause."""
    caplog.set_level(logging.INFO, logger="moriio_async.serving")
    fake = Fake("/prefill", 503, error(True, "decode"))
    proxy, err, retries = await open_with(httpx.MockTransport(fake))
    assert (err.status, err.code, err.type) == (503, "no_healthy_instance", "server_error")
    causes = str(err).removeprefix("no instance could serve the request: ").split("; ")
    assert len(causes) == 3 and all(c.startswith("prefill http://prefill-") for c in causes[:2])
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("attempt")] == [
        f"attempt 1 of cmpl-1 failed: {causes[0]}", f"attempt 2 of cmpl-1 failed: {causes[1]}"
    ]  # fmt: skip
    assert str(err).endswith("; no healthy decode instance") and str(err).count("refused") == 2
    assert fake.calls["/prefill"] == 2 and retries == Counter({"decode": 2})
    assert all(e.healthy and e.in_flight == 0 for e in proxy.fleet.endpoints), "blamed is not down"


@pytest.mark.parametrize("broken", ["transport", "body"])
async def test_a_prefill_instance_that_cannot_answer_is_marked_down_and_avoided(broken: str) -> None:
    fake = Fake("", 0, b"")

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/prefill":
            fake.calls["/prefill"] += 1
            if broken == "transport":
                raise httpx.ConnectError("connection refused")
            return httpx.Response(200, content=b"{not json")
        return fake(request)

    proxy, err, retries = await open_with(httpx.MockTransport(handler))
    assert err.status == 503 and str(err).endswith("; no healthy prefill instance")
    assert fake.calls["/prefill"] == 2 and retries == Counter({"prefill": 2})
    kind = "ConnectError: connection refused" if broken == "transport" else "DecodeError"
    for ep in proxy.fleet.of("prefill"):
        assert not ep.healthy and kind in ep.reason and ep.in_flight == 0
    assert all(e.healthy and e.in_flight == 0 for e in proxy.fleet.of("decode"))


async def test_write_mode_aborts_the_leg_still_running_when_the_other_failed() -> None:
    """WRITE mode runs both legs at once: decode fails at once, so prefill (still waiting for decode's blocks)
    is told to give up; its answer to that is the attempt's error, and the next attempt runs elsewhere."""
    fake = Fake("/generate", 503, error(True, "decode"))
    aborted: dict[str, asyncio.Event] = {}

    async def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/prefill":
            fake.calls[path] += 1
            await aborted.setdefault(msgspec.json.decode(request.content)["request_id"], asyncio.Event()).wait()
            return httpx.Response(504, content=error(True, "decode"))
        if path == "/abort":
            aborted.setdefault(msgspec.json.decode(request.content)["request_id"], asyncio.Event()).set()
        return fake(request)

    proxy, err, retries = await open_with(httpx.MockTransport(handler), "write")
    assert err.status == 503 and retries == Counter({"decode": 2})
    assert {body.request_id for _, body, _ in fake.aborts} == {"cmpl-1-0", "cmpl-1-1"}
    assert all(host.startswith("prefill-") for host, _, _ in fake.aborts)
    assert fake.calls["/prefill"] == fake.calls["/generate"] == 2
    assert all(e.in_flight == 0 for e in proxy.fleet.endpoints)


@pytest.mark.parametrize("status", [500, 503])
async def test_a_5xx_without_an_error_body_is_retried_blaming_the_instance_that_answered(status: int) -> None:
    fake = Fake("/prefill", status, b"<html>oops</html>")
    proxy, err, retries = await open_with(httpx.MockTransport(fake))
    assert err.status == 503 and retries == Counter({"prefill": 2}) and fake.calls["/prefill"] == 2
    for url in PREFILL:
        assert f"prefill {url} answered {status}" in str(err)
    assert all(e.healthy for e in proxy.fleet.endpoints)


@pytest.mark.parametrize("cause", ["prefill", ""], ids=["own-cause", "no-cause"])
async def test_an_error_body_naming_no_other_instance_blames_the_one_that_answered(cause: str) -> None:
    fake = Fake("/prefill", 503, error(True, cause))
    _, err, retries = await open_with(httpx.MockTransport(fake))
    assert err.status == 503 and str(err).endswith("; no healthy prefill instance")
    assert retries == Counter({"prefill": 2}) and fake.calls["/prefill"] == 2


# -- scripted instances behind the proxy: what decode streams, and how it fails ----------------------


class Lines(httpx.AsyncByteStream):
    """Decode's NDJSON body: ``lines``, each after ``gate`` when one is given but the first, then the end, or
    (``reset``) a broken connection; records that the proxy closed it."""

    def __init__(self, lines: list[TokenLine], reset: bool = False, gate: asyncio.Event | None = None) -> None:
        self.lines, self.reset, self.gate, self.closed = lines, reset, gate, False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for i, line in enumerate(self.lines):
            if i and self.gate is not None:
                await self.gate.wait()
            yield msgspec.json.encode(line) + b"\n"
        if self.reset:
            raise httpx.ReadError("connection reset")

    async def aclose(self) -> None:
        self.closed = True


KV_HEADERS = {"x-kv-bytes": "4096", "x-kv-transfer-s": "0.5", "x-kv-exposed-s": "0.75"}
ONE_TOKEN = [TokenLine(token=ord("a")), TokenLine(finish_reason="length")]


class Scripted(Fake):
    """Healthy instances: prefill answers at once (its stats ``stats``), decode streams ``lines`` with
    ``headers``; records the request id and deadline of each leg and the deadline of each health poll."""

    def __init__(self, lines: list[TokenLine], headers: dict[str, str] | None = None, reset: bool = False) -> None:
        super().__init__("", 0, b"")
        self.lines, self.headers, self.reset = lines, headers or {}, reset
        self.stats = TransferStats(exposed_s=0.25)
        self.gate: asyncio.Event | None = None
        self.streams: list[Lines] = []
        self.legs: list[tuple[str, str, object]] = []
        self.polls: list[object] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path, timeout = request.url.path, request.extensions["timeout"]
        if path == "/health":
            self.polls.append(timeout)
        if path not in ("/prefill", "/generate"):
            return super().__call__(request)
        self.calls[path] += 1
        rid = msgspec.json.decode(request.content)["request_id"]
        self.legs.append((path, rid, timeout))
        if path == "/prefill":
            ref = EngineRef(request.url.host, "127.0.0.1:1", 1)
            return httpx.Response(200, content=msgspec.json.encode(PrefillResponse(rid, 9, self.stats, ref, [0])))
        stream = Lines(self.lines, self.reset, self.gate)
        self.streams.append(stream)
        return httpx.Response(200, headers=self.headers, stream=stream)


@contextlib.asynccontextmanager
async def proxy_over(
    handler: Fake, monkeypatch: pytest.MonkeyPatch, mode: str = "read", **settings: float
) -> AsyncIterator[httpx.AsyncClient]:
    """The proxy app (one prefill, one decode instance) over instances answered by ``handler``."""
    client_class = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **_kw: client_class(transport=httpx.MockTransport(handler)))
    config = ProxySettings(["http://prefill-0"], ["http://decode-0"], SMALL, mode=mode, **settings)  # type: ignore[arg-type]
    app = create_proxy_app(config)
    async with app.router.lifespan_context(app):
        monkeypatch.undo()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as proxy:
            yield proxy


def sample(metrics: str, name: str) -> float:
    return float(next(line.split()[-1] for line in metrics.splitlines() if line.startswith(name + " ")))


async def decode_counts(proxy: httpx.AsyncClient) -> tuple[int, int]:
    """The decode instance's requests in flight and served, as the proxy's /health lists them."""
    info = next(i for i in (await proxy.get("/health")).json()["instances"] if i["role"] == "decode")
    return info["in_flight"], info["served"]


@pytest.mark.parametrize("headers", [KV_HEADERS, {}], ids=["kv-headers", "no-kv-headers"])
@pytest.mark.parametrize("mode", ["read", "write"])
async def test_a_completion_reports_decodes_kv_figures_under_the_ids_and_deadlines_the_instances_saw(
    mode: str, headers: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The answer's ``kv_transfer`` is decode's ``x-kv-*`` headers (0 when it sends none), but WRITE's exposed
    time is prefill's (it ends when write_done left); each leg runs under ``<completion id>-0`` and the leg
    deadline, each health poll under twice the poll interval."""
    fake = Scripted(ONE_TOKEN, headers)
    async with proxy_over(fake, monkeypatch, mode, health_interval=2.0) as proxy:
        resp = await proxy.post("/v1/completions", json={"model": SMALL.name, "prompt": "hi", "max_tokens": 1})
        assert resp.status_code == 200, resp.text
        answer = resp.json()
        kv = answer["kv_transfer"]
        exposed = 0.25 if mode == "write" else (0.75 if headers else 0.0)
        figures = (4096, 0.5) if headers else (0, 0.0)
        assert (kv["bytes"], kv["transfer_s"], kv["exposed_s"], kv["attempts"]) == (*figures, exposed, 1)
        assert answer["id"].startswith("cmpl-") and answer["choices"][0]["text"] == "a"
        settings = ProxySettings(PREFILL, DECODE, SMALL)
        deadline = {"connect": settings.control_timeout, "read": settings.leg_timeout}
        deadline |= {"write": settings.leg_timeout, "pool": settings.leg_timeout}
        assert sorted(fake.legs) == [
            ("/generate", answer["id"] + "-0", deadline), ("/prefill", answer["id"] + "-0", deadline)
        ]  # fmt: skip
        assert fake.polls and all(t == dict.fromkeys(("connect", "read", "write", "pool"), 4.0) for t in fake.polls)
        metrics = (await proxy.get("/metrics")).text
        assert sample(metrics, "moriio_proxy_kv_transfer_seconds_sum") == exposed
        assert sample(metrics, "moriio_proxy_ttft_seconds_count") == 1
        assert 0 <= sample(metrics, "moriio_proxy_ttft_seconds_sum") < 60  # a duration, not a clock reading
        assert await decode_counts(proxy) == (0, 1) and fake.streams[0].closed


async def test_streamed_completions_without_usage_end_with_an_empty_last_chunk_and_are_each_counted_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = Scripted(ONE_TOKEN, KV_HEADERS)
    async with proxy_over(fake, monkeypatch) as proxy:
        for options in ({}, {"stream_options": {"include_usage": False}}):
            body = {"model": SMALL.name, "prompt": "hi", "max_tokens": 1, "stream": True} | options
            resp = await proxy.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            events = [e.removeprefix("data: ") for e in resp.text.split("\n\n") if e]
            assert events[-1] == "[DONE]" and len(events) == 3  # the token, the last chunk: no usage chunk
            first, last = (msgspec.json.decode(e) for e in events[:2])
            assert first["choices"][0]["text"] == "a" and first["id"].startswith("cmpl-")
            assert last["choices"][0] == {"index": 0, "text": "", "finish_reason": "length", "logprobs": None}
            assert {(c["id"], c["model"], c["created"]) for c in (first, last)} == {
                (first["id"], SMALL.name, first["created"])
            }  # fmt: skip
            assert last["kv_transfer"]["exposed_s"] == 0.75
        metrics = (await proxy.get("/metrics")).text
        assert sample(metrics, "moriio_proxy_ttft_seconds_count") == 2  # once each, at its one token
        assert 0 <= sample(metrics, "moriio_proxy_ttft_seconds_sum") < 60
        assert await decode_counts(proxy) == (0, 2)
        assert all(s.closed for s in fake.streams)


@pytest.mark.parametrize("how", ["reset", "finish-error", "cut"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
async def test_a_decode_failing_mid_stream_is_a_502_or_an_error_event(
    how: str, stream: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After its first token decode breaks the connection, ends with finish_reason error, or just ends: a plain
    completion is a 502; a streamed one (200 already sent) ends with an error event and no ``[DONE]``."""
    lines = [TokenLine(token=ord("a"))] + ([TokenLine(finish_reason="error")] if how == "finish-error" else [])
    fake = Scripted(lines, KV_HEADERS, reset=how == "reset")
    async with proxy_over(fake, monkeypatch) as proxy:
        body = {"model": SMALL.name, "prompt": "hi", "max_tokens": 4, "stream": stream}
        resp = await proxy.post("/v1/completions", json=body)
        why = "connection reset" if how == "reset" else "decode ended the stream without finishing the completion"
        if stream:
            assert resp.status_code == 200
            events = [msgspec.json.decode(e.removeprefix("data: ")) for e in resp.text.split("\n\n") if e]
            assert len(events) == 2 and events[0]["choices"][0]["text"] == "a"
            err = events[1]["error"]
            assert err["message"] == f"decode http://decode-0 failed mid-stream: {why}"
        else:
            assert resp.status_code == 502
            err = resp.json()["error"]
            message = "decode http://decode-0 failed mid-stream"
            assert err["message"] == (f"{message}: {why}" if how == "reset" else message)
            assert 'status="502"} 1.0' in (await proxy.get("/metrics")).text
        assert err["type"] == "server_error"
        assert await decode_counts(proxy) == (0, 1) and fake.streams[0].closed


async def test_the_proxy_answers_once_decode_has_the_kv_while_it_still_generates() -> None:
    """``open`` returns with decode's first line (its generation goes on): two such streams are two requests
    in flight on the decode instance, until each is finished."""
    fake = Scripted([TokenLine(token=1), TokenLine(token=2), TokenLine(finish_reason="length")])
    fake.gate = asyncio.Event()
    async with httpx.AsyncClient(transport=httpx.MockTransport(fake)) as client:
        proxy = Proxy(ProxySettings(PREFILL[:1], DECODE[:1], SMALL), client)
        await proxy.fleet.check_all()
        async with asyncio.timeout(10):  # only against a hang: an unstreamed leg waits for the gate forever
            atts = [await proxy.open([1, 2], 2, f"cmpl-{i}") for i in range(2)]
            firsts = [await anext(proxy.tokens(att)) for att in atts]
        assert firsts == [TokenLine(token=1)] * 2 and not any(s.closed for s in fake.streams)
        decode = proxy.fleet.of("decode")[0]
        assert decode.in_flight == 2
        fake.gate.set()
        for att in atts:
            await proxy.finish(att)
        assert (decode.in_flight, decode.served) == (0, 2) and all(s.closed for s in fake.streams)


async def test_a_client_gone_before_its_stream_started_still_ends_the_request() -> None:
    """The response's background task finishes the request when the stream never ran (the client left first):
    decode's stream is closed and its instance no longer counts the request in flight."""
    fake = Scripted(ONE_TOKEN)
    async with httpx.AsyncClient(transport=httpx.MockTransport(fake)) as client:
        proxy = Proxy(ProxySettings(PREFILL[:1], DECODE[:1], SMALL), client)
        await proxy.fleet.check_all()
        resp = await proxy.complete(CompletionRequest(model=SMALL.name, prompt="hi", max_tokens=1, stream=True))
        sent: list[Message] = []

        async def gone() -> Message:
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            sent.append(message)
            await asyncio.sleep(0)  # a server's send yields to its transport: the disconnect is seen there

        await resp({"type": "http", "asgi": {"spec_version": "2.0"}}, gone, send)
        assert [m["type"] for m in sent] == ["http.response.start"]
        decode = proxy.fleet.of("decode")[0]
        assert fake.streams[0].closed and (decode.in_flight, decode.served) == (0, 1)


@pytest.mark.parametrize("mode", ["read", "write"])
async def test_a_request_cancelled_during_its_attempt_cancels_its_legs_and_is_not_in_flight(mode: str) -> None:
    """The client went away while the legs ran: the cancellation goes through, and no instance is left with the
    request counted in flight."""
    arrived, never = asyncio.Event(), asyncio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/prefill", "/generate"):
            arrived.set()
            await never.wait()
        return Fake("", 0, b"")(request)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        proxy = Proxy(ProxySettings(PREFILL, DECODE, SMALL, mode=mode), client)  # type: ignore[arg-type]
        await proxy.fleet.check_all()
        task = asyncio.create_task(proxy.open([1, 2], 2, "cmpl-1"))
        await arrived.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert all(e.in_flight == 0 and e.healthy for e in proxy.fleet.endpoints)


async def test_a_request_cancelled_again_while_its_legs_wind_down_still_ends_cancelled() -> None:
    """WRITE: a second cancellation (the server stopping after the client left) lands while both legs still
    close their connections: the request ends cancelled all the same, and nothing stays in flight."""
    both, never = asyncio.Event(), asyncio.Event()
    legs: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/prefill", "/generate"):
            legs.append(request.url.path)
            if len(legs) == 2:
                both.set()
            try:
                await never.wait()
            finally:
                await asyncio.sleep(0)  # closing a connection takes a turn of the loop
        return Fake("", 0, b"")(request)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        proxy = Proxy(ProxySettings(PREFILL, DECODE, SMALL, mode="write"), client)
        await proxy.fleet.check_all()
        task = asyncio.create_task(proxy.open([1, 2], 2, "cmpl-1"))
        await both.wait()
        task.cancel()
        await asyncio.sleep(0)  # the attempt has cancelled its legs and waits for them
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)  # the legs end
        assert all(e.in_flight == 0 for e in proxy.fleet.endpoints)


async def test_write_mode_blames_prefill_when_decode_says_prefill_failed() -> None:
    """WRITE: prefill answered, decode refused naming prefill as the cause (it never pushed): the prefill
    instance is left out and the retry counted against it."""
    fake = Fake("/generate", 503, error(True, "prefill"))
    _, err, retries = await open_with(httpx.MockTransport(fake), "write")
    assert err.status == 503 and str(err).endswith("; no healthy prefill instance")
    assert retries == Counter({"prefill": 2}) and fake.calls["/generate"] == 2


async def test_write_mode_aborts_decode_when_prefill_failed_first() -> None:
    """WRITE: prefill refuses at once while decode waits for its push: decode is the one told to give up."""
    fake = Fake("/prefill", 503, error(True, "prefill"))
    aborted: dict[str, asyncio.Event] = {}

    async def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        rid = msgspec.json.decode(request.content)["request_id"] if request.content else ""
        if path == "/generate":
            fake.calls[path] += 1
            await aborted.setdefault(rid, asyncio.Event()).wait()
            return httpx.Response(503, content=error(True, "prefill"))
        if path == "/abort":
            aborted.setdefault(rid, asyncio.Event()).set()
        return fake(request)

    proxy, err, retries = await open_with(httpx.MockTransport(handler), "write")
    assert err.status == 503 and retries == Counter({"prefill": 2})
    assert {body.request_id for _, body, _ in fake.aborts} == {"cmpl-1-0", "cmpl-1-1"}
    assert all(host.startswith("decode-") for host, _, _ in fake.aborts)
    assert all(e.in_flight == 0 for e in proxy.fleet.endpoints)


async def test_write_mode_closes_decodes_stream_when_prefill_failed_after_decode_answered() -> None:
    """WRITE: decode answered (its stream open), prefill failed: the attempt fails and decode's stream is
    closed, so decode ends its generation instead of holding its blocks for nobody."""
    fake = Scripted(ONE_TOKEN)

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/prefill":
            fake.calls["/prefill"] += 1
            return httpx.Response(503, content=error(True, "prefill"))
        return fake(request)

    proxy, err, retries = await open_with(httpx.MockTransport(handler), "write")
    assert err.status == 503 and retries == Counter({"prefill": 2}) and fake.calls["/generate"] == 2
    assert len(fake.streams) == 2 and all(s.closed for s in fake.streams)
    assert all(e.in_flight == 0 for e in proxy.fleet.endpoints)
