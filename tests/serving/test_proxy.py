"""The proxy's retry rule, against instances faked with ``httpx.MockTransport``: a leg that fails for a reason
another instance would share (a non-retryable 4xx) ends the request at once with a 502; a retryable failure
is tried once more elsewhere, and counted."""

from __future__ import annotations

from collections import Counter

import httpx
import msgspec
import pytest

from moriio_async.serving.api import ApiError
from moriio_async.serving.config import ProxySettings
from moriio_async.serving.kvpool import KVLayout
from moriio_async.serving.messages import EngineRef, ErrorBody, InstanceHealth, PrefillResponse, TransferStats
from moriio_async.serving.model import ModelConfig
from moriio_async.serving.proxy import Proxy

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

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.calls[path] += 1
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
    assert err.status == 502 and "the request failed" in str(err)
    assert fake.calls[leg] == 1  # one attempt: no other instance was asked
    assert retries == 0


@pytest.mark.parametrize("body", [error(True, "prefill"), b"unavailable"], ids=["error-body", "plain"])
async def test_a_retryable_failure_is_tried_on_another_instance_and_counted(body: bytes) -> None:
    fake = Fake("/prefill", 503, body)
    err, retries = await run(fake, "read")
    assert err.status == 503  # both prefill instances refused: nobody left
    assert fake.calls["/prefill"] == 2 and retries == 2
