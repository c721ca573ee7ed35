"""serving.vllm.proxy: the two legs exactly as vLLM's MoRIIO connector expects them, and its retry rules.

The vLLM servers here are stand-ins behind ``httpx.MockTransport`` that record
what they were sent and answer as vLLM does; the real pair runs in
``tests/integrations/test_vllm_pair.py``.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from moriio_async.serving.api import ApiError
from moriio_async.serving.metrics import ProxyMetrics
from moriio_async.serving.vllm.proxy import Peer, VllmProxy, VllmProxySettings

P = Peer("http://127.0.0.1:8100", "127.0.0.1", 6301, 61005)
P2 = Peer("http://127.0.0.1:8101", "127.0.0.1", 6302, 61006)
D = Peer("http://127.0.0.1:8200", "127.0.0.1", 6401, 61105)
RID = re.compile(
    r"^___prefill_addr_host:127\.0\.0\.1,handshake:(\d+),notify:(\d+)"
    r"___decode_addr_host:127\.0\.0\.1,handshake:6401,notify:61105_([0-9a-f]{32})$"
)


class Servers:
    """Stand-in vLLM servers: ``down`` refuse connections, ``silent`` never answer the prefill leg.

    As with vLLM, a decode leg's first token comes only once its KV is there:
    after the prefill leg of the same ``transfer_id`` answered.
    """

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any], str]] = []
        self.down: set[str] = set()
        self.silent: set[str] = set()
        self.kv: dict[str, asyncio.Event] = {}
        self.prefill_answer: object = None  # what a prefill leg answers instead of vLLM's object, when set

    async def handler(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        body = json.loads(request.content)
        self.seen.append((base, body, request.headers["x-request-id"]))
        if base in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if base in self.silent:
            await asyncio.sleep(3600)
        params = body["kv_transfer_params"]
        kv = self.kv.setdefault(params["transfer_id"], asyncio.Event())
        if params.get("do_remote_decode"):
            kv.set()
            if self.prefill_answer is not None:
                return httpx.Response(200, json=self.prefill_answer)
            answer = {
                "choices": [{"text": "x"}],
                "kv_transfer_params": {"remote_engine_id": "e", "remote_block_ids": [[3, 4]]},
            }
            return httpx.Response(200, json=answer)

        async def stream() -> AsyncIterator[bytes]:
            await kv.wait()
            for word in ("a", "b"):
                yield f'data: {{"choices": [{{"text": "{word}"}}]}}\n\n'.encode()
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, content=stream(), headers={"content-type": "text/event-stream"})


def proxy(servers: Servers, mode: str, prefill: list[Peer] | None = None, timeout: float = 0.5) -> VllmProxy:
    settings = VllmProxySettings(prefill=prefill or [P], decode=[D], mode=mode, transfer_timeout=timeout)
    client = httpx.AsyncClient(transport=httpx.MockTransport(servers.handler))
    return VllmProxy(settings, client, ProxyMetrics())


BODY = {"model": "m", "prompt": "hello", "max_tokens": 8, "stream": True, "temperature": 0.0}


@pytest.mark.parametrize("mode", ["read", "write"])
async def test_both_legs_carry_one_transfer_id_and_the_request_id_names_both_peers(mode: str) -> None:
    servers = Servers()
    resp = await proxy(servers, mode).complete(dict(BODY))
    chunks = [part async for part in resp.body_iterator]  # type: ignore[attr-defined]
    assert b"".join(c if isinstance(c, bytes) else c.encode() for c in chunks).count(b"data: ") == 3
    (p_url, pre, p_rid), (d_url, dec, d_rid) = sorted(servers.seen, key=lambda s: s[0])
    assert (p_url, d_url) == (P.url, D.url) and p_rid == d_rid
    m = RID.match(p_rid)
    assert m is not None and m.groups()[:2] == ("6301", "61005"), p_rid
    tid = m.group(3)
    assert pre["max_tokens"] == 1 and pre["stream"] is False and dec["stream"] is True and dec["max_tokens"] == 8
    assert pre["kv_transfer_params"] == {
        "do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid, "remote_host": "127.0.0.1",
        "remote_port": 8200, "remote_handshake_port": 6401, "remote_notify_port": 61105,
        "remote_engine_id": None, "remote_block_ids": None,
    }  # fmt: skip
    want = {"do_remote_decode": False, "do_remote_prefill": True, "transfer_id": tid, "remote_host": "127.0.0.1",
            "remote_port": 8100, "remote_handshake_port": 6301, "remote_notify_port": 61005}  # fmt: skip
    if mode == "read":  # the prefill answer's blocks, so decode knows what to pull
        want |= {"remote_engine_id": "e", "remote_block_ids": [[3, 4]]}
    else:
        want |= {"remote_engine_id": None, "remote_block_ids": None}
    assert dec["kv_transfer_params"] == want
    assert pre["temperature"] == dec["temperature"] == 0.0 and pre["prompt"] == dec["prompt"] == "hello"


@pytest.mark.parametrize("mode", ["read", "write"])
async def test_fields_the_proxy_does_not_know_reach_both_legs_unchanged(mode: str) -> None:
    servers = Servers()
    vendor = {"a": [1, {"b": None, "c": 2.5}], "d": "x"}
    body = {**BODY, "vendor_x": vendor, "max_completion_tokens": 8, "stream_options": {"include_usage": True},
            "kv_transfer_params": {"client": "set"}}  # fmt: skip
    await proxy(servers, mode).complete(body)
    (_, pre, _), (_, dec, _) = sorted(servers.seen, key=lambda s: s[0])
    assert pre["vendor_x"] == dec["vendor_x"] == vendor
    assert pre["max_completion_tokens"] == 1 and "stream_options" not in pre  # the prefill leg makes one token
    assert dec["max_completion_tokens"] == 8 and dec["stream_options"] == {"include_usage": True}
    assert "client" not in pre["kv_transfer_params"] and "client" not in dec["kv_transfer_params"]
    assert set(dec) == set(body) and set(pre) == set(body) - {"stream_options"}


async def test_a_prefill_answer_that_is_not_an_object_fails_the_attempt_in_read_mode() -> None:
    servers = Servers()
    servers.prefill_answer = ["not", "an", "object"]
    with pytest.raises(ApiError) as failed:
        await proxy(servers, "read").complete(dict(BODY))
    assert failed.value.status == 503 and "answered list, not an object" in str(failed.value)
    assert not any(body["kv_transfer_params"].get("do_remote_prefill") for _, body, _ in servers.seen)


@pytest.mark.parametrize("mode", ["read", "write"])
async def test_a_dead_prefill_server_is_left_out_and_the_next_one_serves(mode: str) -> None:
    servers = Servers()
    servers.down.add(P.url)
    px = proxy(servers, mode, prefill=[P, P2])
    await px.complete(dict(BODY))
    await px.complete(dict(BODY))
    prefills = [url for url, body, _ in servers.seen if body["kv_transfer_params"].get("do_remote_decode")]
    assert prefills == [P.url, P2.url, P2.url]  # tried once, then left out for transfer_timeout


@pytest.mark.parametrize("mode", ["read", "write"])
async def test_a_stopped_only_prefill_server_fails_one_request_at_its_deadline_then_the_rest_at_once(
    mode: str,
) -> None:
    servers = Servers()
    servers.silent.add(P.url)
    px = proxy(servers, mode, timeout=0.3)
    t0 = time.monotonic()
    with pytest.raises(ApiError) as first:
        await px.complete(dict(BODY))
    waited = time.monotonic() - t0
    with pytest.raises(ApiError) as second:
        await px.complete(dict(BODY))
    assert first.value.status == second.value.status == 503
    assert "every prefill server failed an attempt" in str(second.value)
    assert waited >= 0.3  # one deadline, not one per attempt: the server is left out after the first
    prefills = [url for url, body, _ in servers.seen if body["kv_transfer_params"].get("do_remote_decode")]
    assert prefills == [P.url]
