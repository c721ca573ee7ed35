"""A decode instance: gets a prompt's KV into its own blocks, then generates, streaming tokens.

``POST /generate`` (from the proxy) allocates blocks for the prompt and the
completion, gets the prompt's KV, and only then answers: 200 with an NDJSON
stream of tokens, or an ``ErrorBody`` (``retryable`` when another prefill
instance may succeed). The KV arrives in one of vLLM MoRIIO's two modes:

* READ: ``batch_read`` of prefill's lent blocks, one batch per layer, contiguous
  blocks merged; then ``release`` to prefill (also after a failure).
* WRITE: ``remote_blocks`` to prefill, then wait for ``write_done`` (which
  carries the first token) or ``write_failed``.

Blocks prefill may still write into are never reused: on a WRITE-mode failure
without prefill's answer (``/abort`` from the proxy, or the wait's deadline),
the blocks are freed only once prefill is known to be gone (unreachable, or
another incarnation), or once it answered.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import FastAPI, Response
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from moriio_async import MoriioError, TransferError, waiting_for_transfer_complete

from .config import InstanceSettings
from .instance import Instance, PeerUnavailable, ServingError, check_prompt
from .kvpool import PoolExhausted, transfer_segments
from .messages import (
    GenerateRequest,
    Release,
    RemoteBlocks,
    TokenLine,
    TransferStats,
    WriteDone,
    WriteFailed,
)
from .web import add_json_route, instance_app

__all__ = ["DecodeServer", "Generation", "create_decode_app"]

log = logging.getLogger("moriio_async.serving")
_END = -1


@dataclass(eq=False)
class _Waiter:
    """A WRITE-mode request waiting for prefill's answer, or for the proxy to give up."""

    answer: asyncio.Future[WriteDone | WriteFailed]
    aborted: asyncio.Event = field(default_factory=asyncio.Event)


class Generation:
    """Greedy decoding of one request as a task: it always ends, and it frees the blocks when it does.

    The task owns the blocks; the HTTP stream only reads its queue. A stream that
    goes away cancels the task (``close``), a stream that never starts lets it
    run out its ``max_tokens``: either way the blocks come back.
    """

    def __init__(self, inst: Instance, req: GenerateRequest, blocks: list[int], first: int) -> None:
        self.inst, self.req, self.blocks, self.first = inst, req, blocks, first
        self.queue: asyncio.Queue[int] = asyncio.Queue()
        self.finish_reason = "error"
        self.task = inst.spawn(self._run(), name=f"generate {req.request_id}")
        # Not a finally in _run: a task cancelled before its first step never enters its body.
        self.task.add_done_callback(self._ended)

    async def _run(self) -> None:
        inst, req = self.inst, self.req
        try:
            token, pos = self.first, len(req.prompt_token_ids)
            self.queue.put_nowait(token)
            for _ in range(req.max_tokens - 1):
                token = await inst.compute(inst.model.decode_step, token, pos, inst.pool.array, self.blocks)
                pos += 1
                self.queue.put_nowait(token)
            self.finish_reason = "length"
        except Exception:
            log.exception("%s: generation of %s failed", inst.settings.name, req.request_id)

    def _ended(self, _task: asyncio.Task[None]) -> None:
        self.inst.pool.free(self.blocks)
        self.queue.put_nowait(_END)

    async def lines(self) -> AsyncIterator[bytes]:
        encoder = msgspec.json.Encoder()
        try:
            while (token := await self.queue.get()) != _END:
                yield encoder.encode(TokenLine(token=token)) + b"\n"
            yield encoder.encode(TokenLine(finish_reason=self.finish_reason)) + b"\n"
        finally:
            self.close()

    def close(self) -> None:
        if not self.task.done():
            self.task.cancel()


class DecodeServer:
    """The decode role of an ``Instance``."""

    def __init__(self, instance: Instance) -> None:
        self.inst = instance
        self.waiters: dict[str, _Waiter] = {}
        self.aborted: dict[str, float] = {}  # request id -> when; an abort may arrive before the request
        instance.handlers[WriteDone] = self._on_answer
        instance.handlers[WriteFailed] = self._on_answer

    async def _on_answer(self, msg: WriteDone | WriteFailed, peer: str) -> None:
        waiter = self.waiters.get(msg.request_id)
        if waiter is not None and not waiter.answer.done():
            waiter.answer.set_result(msg)

    def abort(self, request_id: str) -> None:
        now = time.monotonic()
        horizon = now - self.inst.settings.write_wait_timeout
        for rid in [r for r, t in self.aborted.items() if t < horizon]:
            del self.aborted[rid]
        if len(self.aborted) < 4 * self.inst.pool.num_blocks:
            self.aborted[request_id] = now
        waiter = self.waiters.get(request_id)
        if waiter is not None:
            waiter.aborted.set()

    # -- getting the KV --------------------------------------------------------------------------

    async def _pull(self, req: GenerateRequest, blocks: list[int]) -> tuple[int, TransferStats]:
        inst, s = self.inst, self.inst.settings
        try:
            if req.layout is None or req.first_token is None or len(req.block_ids) != len(blocks):
                raise ServingError(
                    400, "READ mode needs prefill's layout, block_ids (one per prompt block), first_token"
                )
            req.layout.check_blocks(req.block_ids)
            segments = [
                transfer_segments(inst.pool.layout, blocks, req.layout, req.block_ids, layer)
                for layer in range(s.model.n_layers)
            ]
            session = await inst.session_to(req.prefill, cause="prefill")
            with inst.pool.in_flight(blocks):
                posted = time.perf_counter()
                transfers = [session.batch_read(*seg) for seg in segments]
                inst.metrics.watch("read", transfers)
                error: TransferError | None = None
                try:
                    await waiting_for_transfer_complete(transfers, timeout=s.transfer_timeout)
                except TransferError as exc:
                    error = exc
                    raise PeerUnavailable(f"KV reads from {req.prefill.key} failed: {exc}", cause="prefill") from exc
                finally:
                    if any(not t.done() for t in transfers):
                        # Timed out (or we were cancelled): a read may still land, so flush the pair
                        # before the blocks can be freed and reused.
                        await session.abort()
                    inst.metrics.settle("read", transfers, error)
                elapsed = time.perf_counter() - posted
        except ValueError as exc:
            raise ServingError(400, str(exc)) from None
        finally:
            inst.notify_soon(req.prefill, Release(req.request_id))
        nbytes = sum(t.nbytes for t in transfers)
        return req.first_token, TransferStats(bytes=nbytes, transfer_s=elapsed, exposed_s=elapsed)

    async def _await_push(self, req: GenerateRequest, blocks: list[int]) -> tuple[int, TransferStats]:
        inst = self.inst
        await inst.connect_peer(req.prefill, cause="prefill")
        if req.request_id in self.waiters:
            raise ServingError(409, f"request {req.request_id} is already waiting for its KV")
        waiter = _Waiter(asyncio.get_running_loop().create_future())
        if req.request_id in self.aborted:
            waiter.aborted.set()
        self.waiters[req.request_id] = waiter
        try:
            with inst.pool.in_flight(blocks):
                try:
                    await inst.notify(
                        req.prefill, RemoteBlocks(req.request_id, blocks, inst.pool.layout, inst.engine_ref())
                    )
                except (MoriioError, OSError, TimeoutError) as exc:
                    log.info("%s: remote_blocks for %s not sent: %s", inst.settings.name, req.request_id, exc)
                    waiter.aborted.set()  # it may have arrived: settle it like an abort
                answer = await self._answer(req, waiter)
        finally:
            del self.waiters[req.request_id]
        if isinstance(answer, WriteFailed):
            raise PeerUnavailable(f"{req.prefill.key} could not write the KV: {answer.error}", cause="prefill")
        return answer.first_token, answer.stats

    async def _answer(self, req: GenerateRequest, waiter: _Waiter) -> WriteDone | WriteFailed:
        """Prefill's answer; without one, return only when prefill cannot write into our blocks any more."""
        inst = self.inst
        aborted = asyncio.ensure_future(waiter.aborted.wait())
        either: set[asyncio.Future[Any]] = {waiter.answer, aborted}
        try:
            await asyncio.wait(either, timeout=inst.settings.write_wait_timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            aborted.cancel()
        if waiter.answer.done():
            return waiter.answer.result()
        if await inst.peer_gone(req.prefill):
            return WriteFailed(req.request_id, f"{req.prefill.key} is gone")
        # Prefill lives: it answers within its own deadlines (it closes its writes' pair before write_failed).
        try:
            async with asyncio.timeout(inst.settings.write_wait_timeout):
                return await asyncio.shield(waiter.answer)
        except TimeoutError:
            log.error("%s: %s never answered for %s", inst.settings.name, req.prefill.key, req.request_id)
            return WriteFailed(req.request_id, f"{req.prefill.key} never answered")

    # -- the request -------------------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> tuple[Generation, TransferStats]:
        inst = self.inst
        check_prompt(inst.model, req.prompt_token_ids)
        total = len(req.prompt_token_ids) + req.max_tokens
        if req.max_tokens < 1 or total > inst.model.config.max_model_len:
            raise ServingError(
                400, f"max_tokens {req.max_tokens} must be >= 1 and fit in max_model_len with the prompt"
            )
        with inst.request():
            try:
                blocks = await inst.pool.allocate(inst.model.config.blocks_for(total), inst.settings.admission_timeout)
            except PoolExhausted as exc:
                raise ServingError(503, str(exc), retryable=True, cause="decode") from None
            prompt_blocks = blocks[: inst.model.config.blocks_for(len(req.prompt_token_ids))]
            try:
                if req.mode == "read":
                    first, stats = await self._pull(req, prompt_blocks)
                else:
                    first, stats = await self._await_push(req, prompt_blocks)
            except BaseException:
                inst.pool.free(blocks)
                raise
            return Generation(inst, req, blocks, first), stats


async def _generate(srv: DecodeServer, req: GenerateRequest) -> Response:
    gen, stats = await srv.generate(req)
    headers = {"x-kv-" + k.replace("_", "-"): str(v) for k, v in msgspec.structs.asdict(stats).items()}
    return StreamingResponse(
        gen.lines(), media_type="application/x-ndjson", headers=headers, background=BackgroundTask(gen.close)
    )


def create_decode_app(settings: InstanceSettings) -> FastAPI:
    """The decode instance's FastAPI app; its lifespan starts and closes the engine."""
    app, server = instance_app(settings, "decode", DecodeServer)
    add_json_route(app, "/generate", GenerateRequest, server, _generate)
    return app
