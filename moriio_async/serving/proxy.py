"""The OpenAI-compatible proxy of a disaggregated fleet (xPyD).

``POST /v1/completions`` (streamed by server-sent events, or not), ``GET
/v1/models``, ``GET /health``, ``GET /metrics``. For each request the proxy picks
the least-loaded healthy prefill and decode instances and runs the two legs the
way vLLM's MoRIIO proxy does:

* READ: prefill first (it answers with its lent blocks), then decode, which
  pulls the KV and streams tokens.
* WRITE: both at once; decode tells prefill where to write, prefill pushes.

The answer to the client starts only when decode has the KV, so a failure
before that is retried on other instances (a prefill instance that died
mid-transfer, a full pool) and, when none is left, is a clear 503. The other
leg of a failed attempt is told to give up (``/abort``), so no instance keeps
blocks for it. Extra field ``kv_transfer`` on the last chunk (and on a
non-streamed answer) says where the request ran and what its KV transfer cost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
import msgspec
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from .api import ApiError, CompletionRequest, Usage, chunk, completion, error_response, model_card, parse_request
from .config import ProxySettings
from .fleet import Endpoint, Fleet
from .instance import ServingError
from .messages import (
    AbortRequest,
    ErrorBody,
    GenerateRequest,
    KvTransfer,
    PrefillRequest,
    PrefillResponse,
    ProxyHealth,
    TokenLine,
)
from .metrics import CONTENT_TYPE, ProxyMetrics
from .model import decode_text, encode
from .web import json_response, read_body

__all__ = ["Proxy", "ProxySettings", "create_proxy_app"]

log = logging.getLogger("moriio_async.serving")


class LegError(Exception):
    """One leg of an attempt failed; ``blame`` is the instance to avoid on the next attempt."""

    def __init__(self, message: str, blame: Endpoint, *, down: bool = False, retryable: bool = True) -> None:
        super().__init__(message)
        self.blame, self.down, self.retryable = blame, down, retryable


@dataclass(eq=False)
class _Attempt:
    prefill: Endpoint
    decode: Endpoint
    stream: httpx.Response
    kv: KvTransfer = field(default_factory=KvTransfer)
    ended: bool = False


class Proxy:
    """Runs completions over the fleet; one per proxy process."""

    def __init__(self, settings: ProxySettings, client: httpx.AsyncClient) -> None:
        self.settings, self.client = settings, client
        self.fleet = Fleet(
            settings.prefill, settings.decode, client, settings.model.fingerprint(), settings.health_interval
        )
        self.metrics = ProxyMetrics()
        self.created = int(time.time())

    # -- one leg each ------------------------------------------------------------------------------

    def _timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self.settings.leg_timeout, connect=self.settings.control_timeout)

    async def _failed(self, resp: httpx.Response, leg: Endpoint, other: Endpoint) -> LegError:
        body = await resp.aread()
        await resp.aclose()
        try:
            err = msgspec.json.decode(body, type=ErrorBody)
        except msgspec.DecodeError:
            return LegError(f"{leg.role} {leg.url} answered {resp.status_code}", leg, retryable=resp.status_code >= 500)
        blame = other if err.cause == other.role else leg
        return LegError(f"{leg.role} {leg.url}: {err.error}", blame, retryable=err.retryable)

    async def _post(
        self, leg: str, to: Endpoint, other: Endpoint, body: PrefillRequest | GenerateRequest
    ) -> httpx.Response:
        """POST ``body`` to ``to``'s ``/{leg}``, streamed: a transport error is ``to`` down, another status
        than 200 the error its body names (``_failed``, which may blame ``other``)."""
        try:
            resp = await self.client.send(
                self.client.build_request(
                    "POST", f"{to.url}/{leg}", content=msgspec.json.encode(body), timeout=self._timeout()
                ),
                stream=True,
            )
        except httpx.TransportError as exc:
            raise LegError(f"{to.role} {to.url}: {type(exc).__name__}: {exc}", to, down=True) from exc
        if resp.status_code != 200:
            raise await self._failed(resp, to, other)
        return resp

    async def _prefill(self, p: Endpoint, d: Endpoint, req: PrefillRequest) -> PrefillResponse:
        with self.fleet.using(p):
            resp = await self._post("prefill", p, d, req)
            try:
                return msgspec.json.decode(await resp.aread(), type=PrefillResponse)
            except (httpx.TransportError, msgspec.DecodeError) as exc:
                raise LegError(f"prefill {p.url}: {type(exc).__name__}: {exc}", p, down=True) from exc
            finally:
                await resp.aclose()

    async def _generate(self, p: Endpoint, d: Endpoint, req: GenerateRequest) -> httpx.Response:
        return await self._post("generate", d, p, req)

    async def _abort(self, ep: Endpoint, request_id: str) -> None:
        with contextlib.suppress(httpx.HTTPError):
            await self.client.post(
                f"{ep.url}/abort", content=msgspec.json.encode(AbortRequest(request_id)), timeout=self._timeout()
            )

    # -- an attempt: both legs ---------------------------------------------------------------------

    async def _attempt(self, p: Endpoint, d: Endpoint, rid: str, tokens: list[int], max_tokens: int) -> _Attempt:
        assert p.health is not None
        if self.settings.mode == "read":
            pr = await self._prefill(p, d, PrefillRequest(rid, tokens, "read"))
            gen = GenerateRequest(rid, tokens, max_tokens, "read", pr.engine, pr.first_token, pr.block_ids, pr.layout)
            try:
                stream = await self._generate(p, d, gen)
            except LegError:
                await self._abort(p, rid)  # decode may never have taken the lent blocks
                raise
            return _Attempt(p, d, stream, KvTransfer(prefill_compute_s=pr.stats.compute_s))
        gen = GenerateRequest(rid, tokens, max_tokens, "write", p.health.engine)
        d_leg = asyncio.create_task(self._generate(p, d, gen))
        p_leg = asyncio.create_task(self._prefill(p, d, PrefillRequest(rid, tokens, "write")))
        try:
            await asyncio.wait([d_leg, p_leg], return_when=asyncio.FIRST_EXCEPTION)
            if not (d_leg.done() and p_leg.done()):
                # One leg failed: tell the other instance to give up, then let it answer.
                await self._abort(d if p_leg.done() else p, rid)
                await asyncio.wait([d_leg, p_leg])
        except BaseException:
            for leg in (d_leg, p_leg):
                leg.cancel()
            await asyncio.wait([d_leg, p_leg])
            raise
        finally:
            errors = [e for e in (p_leg.exception(), d_leg.exception()) if e is not None] if p_leg.done() else []
            if errors and not d_leg.cancelled() and d_leg.exception() is None:
                await d_leg.result().aclose()
        if errors:
            raise errors[0]
        stats = p_leg.result().stats  # prefill's view: exposed_s runs until write_done left
        return _Attempt(p, d, d_leg.result(), KvTransfer(prefill_compute_s=stats.compute_s, exposed_s=stats.exposed_s))

    async def open(self, tokens: list[int], max_tokens: int, cid: str) -> _Attempt:
        """An open decode stream for the request, retried over instances; ``ApiError(503)`` when none can."""
        excluded: set[Endpoint] = set()
        causes: list[str] = []
        for attempt in range(self.settings.max_attempts):
            p = self.fleet.pick("prefill", excluded)
            d = self.fleet.pick("decode", excluded)
            if p is None or d is None:
                causes.append(f"no healthy {'prefill' if p is None else 'decode'} instance")
                break
            d.in_flight += 1
            try:
                result = await self._attempt(p, d, f"{cid}-{attempt}", tokens, max_tokens)
            except LegError as exc:
                d.in_flight -= 1
                causes.append(str(exc))
                excluded.add(exc.blame)
                if exc.down:
                    self.fleet.mark_down(exc.blame, str(exc))
                if not exc.retryable:
                    raise ApiError(502, f"the request failed: {exc}", type="server_error") from None
                self.metrics.retries.labels(exc.blame.role).inc()
                log.info("attempt %d of %s failed: %s", attempt + 1, cid, exc)
                continue
            except BaseException:
                d.in_flight -= 1
                raise
            result.kv.attempts = attempt + 1
            return result
        raise ApiError(
            503,
            "no instance could serve the request: " + "; ".join(causes),
            type="server_error",
            code="no_healthy_instance",
        )

    # -- the completion ------------------------------------------------------------------------------

    def check(self, req: CompletionRequest) -> tuple[list[int], int]:
        c = self.settings.model
        if req.model != c.name:
            raise ApiError(404, f"The model `{req.model}` does not exist.", param="model", code="model_not_found")
        tokens = encode(req.text())
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        if len(tokens) + max_tokens > c.max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {c.max_model_len} tokens. However, you requested "
                f"{len(tokens) + max_tokens} tokens ({len(tokens)} in the prompt, {max_tokens} in the completion).",
                param="prompt" if len(tokens) >= c.max_model_len else "max_tokens",
                code="context_length_exceeded",
            )
        return tokens, max_tokens

    async def tokens(self, att: _Attempt) -> AsyncIterator[TokenLine]:
        decoder = msgspec.json.Decoder(TokenLine)
        async for line in att.stream.aiter_lines():
            if line:
                yield decoder.decode(line)

    async def finish(self, att: _Attempt) -> None:
        """Close the decode stream and account the request, once (also when the client left early)."""
        await att.stream.aclose()
        if att.ended:
            return
        att.ended = True
        att.decode.in_flight -= 1
        att.decode.served += 1
        h = att.stream.headers
        kv = att.kv
        kv.mode, kv.prefill, kv.decode = self.settings.mode, att.prefill.url, att.decode.url
        kv.bytes = int(h.get("x-kv-bytes", 0))
        kv.transfer_s = float(h.get("x-kv-transfer-s", 0))
        if kv.exposed_s is None:  # READ: the decode instance's; WRITE set the prefill's at the attempt
            kv.exposed_s = float(h.get("x-kv-exposed-s", 0))
        self.metrics.kv_transfer.observe(kv.exposed_s)

    async def complete(self, req: CompletionRequest) -> Response:
        tokens, max_tokens = self.check(req)
        cid = f"cmpl-{uuid.uuid4().hex}"
        started = time.perf_counter()
        att = await self.open(tokens, max_tokens, cid)
        model = self.settings.model.name
        if req.stream:
            return StreamingResponse(
                self._sse(
                    att, cid, model, len(tokens), started, bool(req.stream_options and req.stream_options.include_usage)
                ),
                media_type="text/event-stream",
                background=BackgroundTask(self.finish, att),
            )
        out: list[int] = []
        reason = "error"
        try:
            async for line in self.tokens(att):
                if line.token is not None:
                    if not out:
                        self.metrics.ttft.observe(time.perf_counter() - started)
                    out.append(line.token)
                elif line.finish_reason:
                    reason = line.finish_reason
        except httpx.HTTPError as exc:
            raise ApiError(502, f"decode {att.decode.url} failed mid-stream: {exc}", type="server_error") from None
        finally:
            await self.finish(att)
        if reason == "error":
            raise ApiError(502, f"decode {att.decode.url} failed mid-stream", type="server_error")
        usage = Usage.of(len(tokens), len(out))
        return json_response(completion(cid, model, decode_text(out), reason, usage, att.kv))

    async def _sse(
        self, att: _Attempt, cid: str, model: str, n_prompt: int, started: float, include_usage: bool
    ) -> AsyncIterator[bytes]:
        enc = msgspec.json.Encoder()
        created, n = int(time.time()), 0
        try:
            async for line in self.tokens(att):
                if line.token is not None:
                    if n == 0:
                        self.metrics.ttft.observe(time.perf_counter() - started)
                    n += 1
                    yield b"data: " + enc.encode(chunk(cid, model, created, decode_text([line.token]), None)) + b"\n\n"
                elif line.finish_reason and line.finish_reason != "error":
                    await self.finish(att)
                    last = chunk(cid, model, created, "", line.finish_reason, kv_transfer=att.kv)
                    yield b"data: " + enc.encode(last) + b"\n\n"
                    if include_usage:
                        usage = Usage.of(n_prompt, n)
                        yield b"data: " + enc.encode(chunk(cid, model, created, "", None, usage=usage)) + b"\n\n"
                    yield b"data: [DONE]\n\n"
                    return
            raise httpx.ReadError("decode ended the stream without finishing the completion")
        except httpx.HTTPError as exc:
            err = ApiError(502, f"decode {att.decode.url} failed mid-stream: {exc}", type="server_error")
            yield b"data: " + enc.encode(err.body()) + b"\n\n"
        finally:
            await self.finish(att)


def create_proxy_app(settings: ProxySettings) -> FastAPI:
    """The proxy's FastAPI app; its lifespan opens the HTTP client and starts health polling."""
    holder: list[Proxy] = []

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        async with httpx.AsyncClient(limits=limits) as client:
            proxy = Proxy(settings, client)
            await proxy.fleet.start()
            holder.append(proxy)
            try:
                yield
            finally:
                await proxy.fleet.close()

    app = FastAPI(title="moriio_async disaggregated serving proxy", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> Response:
        return error_response(exc)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> Response:
        return error_response(ApiError(exc.status_code, str(exc.detail), code=str(exc.status_code)))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        proxy = holder[0]
        proxy.metrics.requests_in_flight.inc()
        status = 500
        try:
            try:
                body = await read_body(request)
            except ServingError as exc:
                raise ApiError(exc.status, str(exc)) from None
            response = await proxy.complete(parse_request(body))
            status = response.status_code
            return response
        except ApiError as exc:
            status = exc.status
            raise
        finally:
            proxy.metrics.requests_in_flight.dec()
            proxy.metrics.requests.labels(str(status)).inc()

    @app.get("/v1/models")
    async def models() -> Response:
        c = settings.model
        return json_response({"object": "list", "data": [model_card(c.name, c.max_model_len, holder[0].created)]})

    @app.get("/health")
    async def health() -> Response:
        fleet = holder[0].fleet
        body = ProxyHealth(ready=fleet.ready(), mode=settings.mode, instances=[e.describe() for e in fleet.endpoints])
        return json_response(body, 200 if fleet.ready() else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(holder[0].metrics.render(), media_type=CONTENT_TYPE)

    return app
