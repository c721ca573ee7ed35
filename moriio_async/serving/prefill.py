"""A prefill instance: computes a prompt's KV into its paged blocks and hands it to decode.

``POST /prefill`` (from the proxy) in the two modes of vLLM's MoRIIO connector:

* READ: compute into our blocks, lend them (in flight) and answer with their ids;
  decode pulls them with ``batch_read`` and sends ``release``. A lease that is
  never released expires after ``lease_timeout`` (the reader died).
* WRITE: meet decode's ``remote_blocks`` for the request, compute, and push each
  layer with ``batch_write`` as soon as the model has produced it; await them all
  (``transfer_timeout``), then send ``write_done``. On any failure send
  ``write_failed`` once nothing of ours can still land in decode's blocks (a
  timed-out transfer closes the session first, decode's half of the pair with
  it, ahead of ``write_failed`` on the same link): decode never waits forever.

``POST /abort`` is the proxy giving up on a request (its other leg failed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from fastapi import FastAPI, Response

from moriio_async import MoriioError, Session, Transfer, TransferError, waiting_for_transfer_complete

from .config import InstanceSettings
from .instance import Instance, PeerUnavailable, ServingError, check_prompt
from .kvpool import PoolExhausted, transfer_segments
from .messages import (
    PrefillRequest,
    PrefillResponse,
    Release,
    RemoteBlocks,
    TransferStats,
    WriteDone,
    WriteFailed,
)
from .rendezvous import Abandoned, Rendezvous
from .web import add_json_route, instance_app, json_response

__all__ = ["PrefillServer", "create_prefill_app"]

log = logging.getLogger("moriio_async.serving")


@dataclass(eq=False)
class _Lease:
    blocks: list[int]
    timer: asyncio.TimerHandle


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class PrefillServer:
    """The prefill role of an ``Instance``."""

    def __init__(self, instance: Instance) -> None:
        self.inst = instance
        s = instance.settings
        self.leases: dict[str, _Lease] = {}
        self.rendezvous = Rendezvous(ttl=s.control_timeout, limit=4 * s.num_blocks, on_orphan=self._orphaned)
        instance.handlers[RemoteBlocks] = self._on_remote_blocks
        instance.handlers[Release] = self._on_release

    # -- READ mode ---------------------------------------------------------------------------------

    def _lend(self, request_id: str, blocks: list[int]) -> None:
        ttl = self.inst.settings.lease_timeout
        self.inst.pool.begin_flight(blocks)
        timer = asyncio.get_running_loop().call_later(ttl, self._expire_lease, request_id)
        self.leases[request_id] = _Lease(blocks, timer)

    def _end_lease(self, request_id: str) -> bool:
        lease = self.leases.pop(request_id, None)
        if lease is None:
            return False
        lease.timer.cancel()
        self.inst.pool.end_flight(lease.blocks)
        self.inst.pool.free(lease.blocks)
        return True

    def _expire_lease(self, request_id: str) -> None:
        if self._end_lease(request_id):
            log.warning("%s: blocks of %s never released; lease expired", self.inst.settings.name, request_id)

    async def _on_release(self, msg: Release, peer: str) -> None:
        self._end_lease(msg.request_id)

    # -- WRITE mode --------------------------------------------------------------------------------

    async def _on_remote_blocks(self, msg: RemoteBlocks, peer: str) -> None:
        refused = self.rendezvous.deliver(msg)
        if refused:
            self._orphaned(msg, refused)

    def _orphaned(self, msg: RemoteBlocks, why: str) -> None:
        self.inst.notify_soon(msg.decode, WriteFailed(msg.request_id, why))

    async def _push(self, req: PrefillRequest, blocks: list[int]) -> tuple[int, TransferStats, RemoteBlocks]:
        inst, s = self.inst, self.inst.settings
        try:
            remote = await self.rendezvous.claim(req.request_id, s.control_timeout)
        except Abandoned as exc:
            raise ServingError(504, f"no KV destination: {exc}", retryable=True, cause="decode") from None
        session: Session | None = None
        transfers: list[Transfer] = []
        try:
            n = len(blocks)
            if len(remote.block_ids) != n:
                raise ServingError(400, f"decode offered {len(remote.block_ids)} blocks for {n}")
            remote.layout.check_blocks(remote.block_ids)
            segments = [
                transfer_segments(inst.pool.layout, blocks, remote.layout, remote.block_ids, layer)
                for layer in range(s.model.n_layers)
            ]
            session = await inst.session_to(remote.decode, cause="decode")
            first, stats, computed = await self._compute_and_write(req, blocks, session, segments, transfers)
        except BaseException as exc:
            if session is not None and any(not t.done() for t in transfers):
                # Nothing of ours may land in decode's blocks after it hears write_failed: an abort ends
                # our side; closing has decode close its half too, ahead of write_failed on the same link.
                await inst.close_session(remote.decode, session)
            self._orphaned(remote, f"{type(exc).__name__}: {exc}")
            if isinstance(exc, ValueError):
                raise ServingError(400, str(exc)) from exc
            raise
        # Decode's figure (its x-kv-* headers) runs until write_done leaves.
        stats.exposed_s = time.perf_counter() - computed
        try:
            await inst.notify(remote.decode, WriteDone(req.request_id, first, stats))
        except (MoriioError, OSError, TimeoutError) as exc:
            raise PeerUnavailable(f"write_done not delivered: {exc}", cause="decode") from exc
        # What the proxy hears includes sending write_done: decode waits for it, not for the bytes.
        stats.exposed_s = time.perf_counter() - computed
        return first, stats, remote

    async def _compute_and_write(
        self,
        req: PrefillRequest,
        blocks: list[int],
        session: Session,
        segments: list[tuple[list[int], list[int], list[int]]],
        transfers: list[Transfer],
    ) -> tuple[int, TransferStats, float]:
        """The first token, the transfer figures, and when the compute ended (``exposed_s`` runs from then)."""
        inst = self.inst
        loop = asyncio.get_running_loop()
        intervals: list[tuple[float, float]] = []
        post_errors: list[BaseException] = []
        job_open = True

        def post(layer: int) -> None:  # on the loop, as soon as the model thread finished the layer
            if not job_open:  # the job ended (cancelled, failed): nothing more goes to decode
                return
            try:
                t = session.batch_write(*segments[layer])
            except Exception as exc:  # e.g. the session closed: reported once compute returns
                post_errors.append(exc)
                return
            posted = time.perf_counter()
            t.add_done_callback(lambda _t: intervals.append((posted, time.perf_counter())))
            inst.metrics.watch("write", [t])
            transfers.append(t)

        def on_layer(layer: int) -> None:  # on the model thread
            loop.call_soon_threadsafe(post, layer)

        started = time.perf_counter()
        with inst.pool.in_flight(blocks):
            try:
                # The model thread queues each layer's post before it returns, so every post has run
                # (call_soon_threadsafe is FIFO) by the time this await resumes.
                first = await inst.compute(inst.model.prefill, req.prompt_token_ids, inst.pool.array, blocks, on_layer)
            finally:
                job_open = False
            computed = time.perf_counter()
            if post_errors or len(transfers) != len(segments):
                raise PeerUnavailable(f"posting the KV writes failed: {post_errors}", cause="decode")
            error: TransferError | None = None
            try:
                await waiting_for_transfer_complete(transfers, timeout=inst.settings.transfer_timeout)
            except TransferError as exc:
                error = exc
                raise PeerUnavailable(f"KV writes to decode failed: {exc}", cause="decode") from exc
            finally:
                inst.metrics.settle("write", transfers, error)
        stats = TransferStats(
            bytes=sum(t.nbytes for t in transfers), transfer_s=busy_time(intervals), compute_s=computed - started
        )
        return first, stats, computed

    # -- the request ---------------------------------------------------------------------------------

    async def prefill(self, req: PrefillRequest) -> PrefillResponse:
        inst = self.inst
        check_prompt(inst.model, req.prompt_token_ids)
        with inst.request():
            try:
                blocks = await inst.pool.allocate(
                    inst.model.config.blocks_for(len(req.prompt_token_ids)), inst.settings.admission_timeout
                )
            except PoolExhausted as exc:
                self.rendezvous.abandon(req.request_id)
                raise ServingError(503, str(exc), retryable=True, cause="prefill") from None
            if req.mode == "write":
                try:
                    first, stats, _ = await self._push(req, blocks)
                finally:
                    inst.pool.free(blocks)
                return PrefillResponse(req.request_id, first, stats, inst.engine_ref())
            try:
                started = time.perf_counter()
                first = await inst.compute(inst.model.prefill, req.prompt_token_ids, inst.pool.array, blocks)
                stats = TransferStats(compute_s=time.perf_counter() - started)
            except BaseException:
                inst.pool.free(blocks)
                raise
            if req.request_id in self.leases:
                inst.pool.free(blocks)
                raise ServingError(409, f"request {req.request_id} already holds blocks here")
            self._lend(req.request_id, blocks)
            return PrefillResponse(req.request_id, first, stats, inst.engine_ref(), blocks, inst.pool.layout)

    def abort(self, request_id: str) -> None:
        """The proxy gave up on ``request_id``: end its lease (READ), refuse its blocks (WRITE)."""
        self.rendezvous.abandon(request_id)
        self._end_lease(request_id)


async def _prefill(srv: PrefillServer, req: PrefillRequest) -> Response:
    return json_response(await srv.prefill(req))


def create_prefill_app(settings: InstanceSettings) -> FastAPI:
    """The prefill instance's FastAPI app; its lifespan starts and closes the engine."""
    app, server = instance_app(settings, "prefill", PrefillServer)
    add_json_route(app, "/prefill", PrefillRequest, server, _prefill)
    return app
