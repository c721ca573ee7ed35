"""An OpenAI proxy in front of vLLM prefill and decode servers, speaking vLLM's MoRIIO convention.

For each ``POST /v1/completions`` (streamed or not) the proxy picks a prefill
and a decode server round-robin and runs the two legs as vLLM's MoRIIO toy
proxy does, with the same ``kv_transfer_params`` and an ``X-Request-Id`` that
carries both peers' addresses
(``___prefill_addr_host:H,handshake:P,notify:N___decode_addr_..._<32 hex>``):

* the prefill leg: the client's body with ``max_tokens=1``, not streamed, and
  ``do_remote_decode`` plus the decode server's addresses;
* the decode leg: the client's body with ``do_remote_prefill`` plus the prefill
  server's addresses; in READ mode after the prefill leg, with the
  ``remote_engine_id`` and ``remote_block_ids`` it answered; in WRITE mode at
  the same time (decode tells prefill where to write).

Both legs carry one ``transfer_id``: vLLM names a request
``cmpl-<X-Request-Id>-<n>-<random>``, differently on each server, and the
connector would otherwise derive two different ids from those names.

Nothing reaches the client before the decode leg's first token, so an attempt
that fails before it is retried with the next prefill server, up to
``max_attempts``; the losing legs are closed, which makes vLLM abort them.
Deadlines, each ``transfer_timeout``: for the prefill leg's answer (a killed
server fails at once, a stopped one at this deadline), and for the decode
leg's first token, counted from when its KV can move (READ: the decode leg's
start, the prefill leg being done; WRITE: the prefill leg's answer, or the
decode leg's start if that is later). A prefill server whose attempt failed
is left out for ``transfer_timeout``, so a request never waits twice on a
server that is down; when none is left the client gets a 503 in OpenAI's
error shape at once. ``GET /health``, ``GET /v1/models`` (the decode server's), ``GET /metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from ..api import ApiError, JsonObject, JsonValue, error_response
from ..metrics import CONTENT_TYPE, ProxyMetrics
from ..web import read_body

__all__ = ["KvTransferParams", "Peer", "VllmProxy", "VllmProxySettings", "create_vllm_proxy_app", "request_id_for"]

log = logging.getLogger("moriio_async.serving")


class KvTransferParams(msgspec.Struct, kw_only=True):
    """vLLM MoRIIO's ``kv_transfer_params`` as the proxy writes them into a leg: the other server's addresses,
    which side of the transfer this leg is, and the ``transfer_id`` both legs share."""

    remote_host: str
    remote_port: int
    remote_handshake_port: int
    remote_notify_port: int
    remote_engine_id: JsonValue = None
    """READ mode's decode leg: the prefill answer's, forwarded as it came (None otherwise)."""
    remote_block_ids: JsonValue = None
    """READ mode's decode leg: the prefill answer's, forwarded as it came (None otherwise)."""
    do_remote_decode: bool
    do_remote_prefill: bool
    transfer_id: str


@dataclass(frozen=True, slots=True)
class Peer:
    """A vLLM server with the MoRIIO connector: its HTTP URL and the connector's ports."""

    url: str
    host: str
    handshake_port: int
    notify_port: int

    @property
    def http_port(self) -> int:
        return int(self.url.rsplit(":", 1)[1].split("/", 1)[0])

    def zmq_address(self) -> str:
        return f"host:{self.host},handshake:{self.handshake_port},notify:{self.notify_port}"

    def params(self, transfer_id: str, *, decode: bool) -> KvTransferParams:
        """This server as the other end of a leg: of the prefill leg when it is the ``decode`` server, else of
        the decode leg (it is the prefill server)."""
        return KvTransferParams(
            remote_host=self.host,
            remote_port=self.http_port,
            remote_handshake_port=self.handshake_port,
            remote_notify_port=self.notify_port,
            do_remote_decode=decode,
            do_remote_prefill=not decode,
            transfer_id=transfer_id,
        )


@dataclass(frozen=True, slots=True)
class VllmProxySettings:
    prefill: list[Peer]
    decode: list[Peer]
    mode: str = "write"
    transfer_timeout: float = 30.0
    max_attempts: int = 3


def request_id_for(prefill: Peer, decode: Peer, transfer_id: str) -> str:
    """vLLM MoRIIO's request id: both peers' addresses, then 32 hex digits."""
    return f"___prefill_addr_{prefill.zmq_address()}___decode_addr_{decode.zmq_address()}_{transfer_id}"


class AttemptFailed(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class _Opened:
    """A decode leg whose first chunk has arrived: the answer can start."""

    response: httpx.Response
    first: bytes
    chunks: AsyncIterator[bytes]
    prefill: asyncio.Task[httpx.Response] | None


class VllmProxy:
    def __init__(self, settings: VllmProxySettings, client: httpx.AsyncClient, metrics: ProxyMetrics) -> None:
        self.settings, self.client, self.metrics = settings, client, metrics
        self._p = itertools.cycle(range(len(settings.prefill)))
        self._d = itertools.cycle(range(len(settings.decode)))
        self._down_until: dict[str, float] = {}  # prefill URL -> when it may be tried again

    def _next_prefill(self) -> Peer | None:
        """The next prefill server round-robin that is not left out; None when all are."""
        now = time.monotonic()
        for _ in range(len(self.settings.prefill)):
            p = self.settings.prefill[next(self._p)]
            if self._down_until.get(p.url, 0.0) <= now:
                return p
        return None

    async def _post_prefill(self, p: Peer, body: JsonObject, headers: dict[str, str]) -> httpx.Response:
        timeout = self.settings.transfer_timeout
        try:
            async with asyncio.timeout(timeout):  # one total deadline: httpx's own is per read
                resp = await self.client.post(f"{p.url}/v1/completions", json=body, headers=headers)
        except TimeoutError as exc:
            raise AttemptFailed("prefill_timeout", f"prefill {p.url}: no answer within {timeout:g}s") from exc
        except httpx.HTTPError as exc:
            raise AttemptFailed("prefill_down", f"prefill {p.url}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code != 200:
            raise AttemptFailed("prefill_error", f"prefill {p.url} answered {resp.status_code}: {resp.text[:300]}")
        return resp

    async def _attempt(self, body: JsonObject, p: Peer, d: Peer) -> _Opened:
        tid = uuid.uuid4().hex
        headers = {"X-Request-Id": request_id_for(p, d, tid)}
        pre = _prefill_leg(body, d.params(tid, decode=True))
        params = p.params(tid, decode=False)
        prefill_task: asyncio.Task[httpx.Response] | None = None
        if self.settings.mode == "read":
            answer: JsonValue = (await self._post_prefill(p, pre, headers)).json()
            if not isinstance(answer, dict):
                raise AttemptFailed("prefill_error", f"prefill {p.url} answered {type(answer).__name__}, not an object")
            given = answer.get("kv_transfer_params")
            if isinstance(given, dict):
                params.remote_engine_id = given.get("remote_engine_id")
                params.remote_block_ids = given.get("remote_block_ids")
        else:
            prefill_task = asyncio.create_task(self._post_prefill(p, pre, headers))
        dec: JsonObject = {**body, "kv_transfer_params": _json(params)}
        request = self.client.build_request("POST", f"{d.url}/v1/completions", json=dec, headers=headers)
        try:
            resp = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            await _cancel(prefill_task)
            raise AttemptFailed("decode_down", f"decode {d.url}: {type(exc).__name__}: {exc}") from exc
        chunks = resp.aiter_raw()
        try:
            first = await self._first_chunk(resp, chunks, prefill_task)
        except BaseException:
            await resp.aclose()
            await _cancel(prefill_task)
            raise
        return _Opened(resp, first, chunks, prefill_task)

    async def _first_chunk(
        self, resp: httpx.Response, chunks: AsyncIterator[bytes], prefill: asyncio.Task[httpx.Response] | None
    ) -> bytes:
        """The decode leg's first bytes, within ``transfer_timeout``; the prefill leg's failure ends the wait."""
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            raise AttemptFailed("decode_error", f"decode answered {resp.status_code}: {text[:300]}")
        first = asyncio.ensure_future(anext(chunks))
        waiting: set[asyncio.Future[Any]] = {first} | ({prefill} if prefill is not None else set())
        timeout = self.settings.transfer_timeout
        deadline = time.monotonic() + timeout
        try:
            while not first.done():
                if prefill is not None and not prefill.done():
                    deadline = time.monotonic() + timeout  # WRITE: the KV moves once prefill answered
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AttemptFailed("timeout", f"no token within {timeout:g}s of the KV being ready to move")
                done, _ = await asyncio.wait(waiting, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                if prefill is not None and prefill in done:
                    waiting.discard(prefill)
                    prefill.result()  # raises AttemptFailed when the prefill leg failed
                    deadline = time.monotonic() + timeout
            try:
                data = first.result()
            except (StopAsyncIteration, httpx.HTTPError) as exc:
                raise AttemptFailed("decode_error", f"decode leg ended before its first token: {exc!r}") from exc
            if data.startswith(b"data: ") and b'"error"' in data[:200]:
                raise AttemptFailed("decode_error", f"decode leg failed: {data[:300]!r}")
            return data
        finally:
            await _cancel(first)

    async def open(self, body: JsonObject) -> _Opened:
        errors: list[str] = []
        for attempt in range(self.settings.max_attempts):
            p = self._next_prefill()
            if p is None:
                errors.append("every prefill server failed an attempt in the last transfer_timeout")
                break
            d = self.settings.decode[next(self._d)]
            try:
                return await self._attempt(body, p, d)
            except AttemptFailed as exc:
                errors.append(str(exc))
                self._down_until[p.url] = time.monotonic() + self.settings.transfer_timeout
                log.warning("attempt %d failed (%s): %s", attempt + 1, exc.reason, exc)
                if attempt + 1 < self.settings.max_attempts:
                    self.metrics.retries.labels(exc.reason).inc()
        message = "no prefill/decode pair could serve the request: " + " | ".join(errors)
        raise ApiError(503, message, type="server_error")

    async def complete(self, body: JsonObject) -> Response:
        """Serve one ``/v1/completions`` body: every field the client sent reaches both legs unchanged, but
        those the legs set (``kv_transfer_params``; on the prefill leg ``max_tokens``, ``stream``, ...)."""
        started = time.monotonic()
        opened = await self.open(body)
        self.metrics.ttft.observe(time.monotonic() - started)

        async def rest() -> AsyncIterator[bytes]:
            try:
                yield opened.first
                async for data in opened.chunks:
                    yield data
            finally:
                await opened.response.aclose()
                if opened.prefill is not None:  # WRITE: the prefill leg ends once its KV is written
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(opened.prefill, self.settings.transfer_timeout)
                    await _cancel(opened.prefill)

        if body.get("stream"):
            media = opened.response.headers.get("content-type", "text/event-stream")
            return StreamingResponse(rest(), media_type=media)
        data = b"".join([part async for part in rest()])
        return Response(data, media_type="application/json")


def _prefill_leg(body: JsonObject, params: KvTransferParams) -> JsonObject:
    """The client's body for the prefill leg: one token, not streamed, with ``params``."""
    prefill: JsonObject = {**body, "max_tokens": 1, "stream": False}
    prefill.pop("stream_options", None)
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    prefill["kv_transfer_params"] = _json(params)
    return prefill


def _json(params: KvTransferParams) -> JsonObject:
    out: JsonObject = msgspec.to_builtins(params)
    return out


async def _cancel(task: asyncio.Future[Any] | None) -> None:
    if task is None or task.done():
        if task is not None and not task.cancelled():
            task.exception()  # retrieved, so asyncio does not log it as never retrieved
        return
    task.cancel()
    with contextlib.suppress(BaseException):
        await task


def create_vllm_proxy_app(settings: VllmProxySettings) -> FastAPI:
    metrics = ProxyMetrics()
    state: dict[str, VllmProxy] = {}

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), limits=limits) as client:
            state["proxy"] = VllmProxy(settings, client, metrics)
            yield

    app = FastAPI(title="moriio_async vLLM proxy", lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        status = 200
        metrics.requests_in_flight.inc()
        try:
            try:
                body: JsonValue = json.loads(await read_body(request))
                if not isinstance(body, dict):
                    raise ValueError("the body is not a JSON object")
            except ValueError as exc:
                raise ApiError(400, f"bad request body: {exc}") from exc
            return await state["proxy"].complete(body)
        except ApiError as exc:
            status = exc.status
            return error_response(exc)
        finally:
            metrics.requests_in_flight.dec()
            metrics.requests.labels(str(status)).inc()

    @app.get("/v1/models")
    async def models() -> Response:
        resp = await state["proxy"].client.get(f"{settings.decode[0].url}/v1/models", timeout=5.0)
        return Response(resp.content, status_code=resp.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app
