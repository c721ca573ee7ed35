"""What the integration does about remote engines in vLLM's MoRIIO worker: bounded handshakes, contained failures.

vLLM 0.32's MoRIIO worker (``MoRIIOConnectorWorker``) has three ways to die
or hang when a prefill server dies, stops or restarts under a decode server
in READ mode; each is closed here without a change to vLLM's source:

1. **A handshake without a deadline.** ``_moriio_handshake`` asks the remote
   engine for its metadata over a ZMQ DEALER socket and waits in ``recv``
   with no timeout. ZMQ connects lazily and queues the request, so a peer that
   is dead (nothing listens) or stopped (the kernel still accepts) leaves the
   worker blocked for ever, and with it the whole decode server.
   :func:`bounded_zmq_ctx` gives the handshake's DEALER sockets a receive
   timeout (the connector's ``transfer_timeout``); the handshake then fails
   with ``zmq.Again``, which vLLM already turns into ``HandshakeError``.
2. **A failed handshake fails the engine.** ``_eager_handshake_all_dp_ranks``
   raises ``HandshakeError`` out of ``start_load_kv`` (on purpose: every TP
   rank then fails the same step), and an exception out of a worker's step
   ends vLLM's EngineCore. :class:`PeerCaches` runs it one remote engine at a
   time and turns a failed engine into failed loads of the requests that
   read from it: their blocks go to ``get_block_ids_with_load_errors``, so the
   scheduler recomputes them (``kv_load_failure_policy="recompute"``) or fails
   those requests (``"fail"``, vLLM's default), and the server goes on. Every
   TP rank sees the same verdict (vLLM votes before raising), so all ranks
   drop the same requests.
3. **A restarted peer is never handshaken again.** The worker handshakes
   once per remote engine id (``host:handshake_port``) and keeps its agents,
   layer descriptors and sessions for good; a restarted prefill server keeps
   its id, and moriio_async refuses to reach a new incarnation through its
   predecessor's descriptors. After each failed read, :class:`PeerCaches`
   forgets every cache entry of remote engines whose sessions are no longer
   alive (``IOEngineSession.alive()``), including the "already eagerly
   handshaken" mark, so the next request that names the engine handshakes
   with whatever incarnation answers. It also looks before each step's reads,
   so a peer that died while nothing was read from it (every request to it
   failed on the prefill leg) costs no failed read at all. (Forgetting the caches but not the mark
   is what crashed the engine before: the read path then looks up the
   forgotten descriptors.)

Nothing is done when the worker lacks the names used here (another vLLM):
the integration says so once in the log and leaves vLLM as it is.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

__all__ = ["PEER_CACHES", "PeerCaches", "bounded_zmq_ctx", "engine_of"]

log = logging.getLogger("moriio_async")

# What vLLM 0.32's MoRIIO worker caches per remote engine after a handshake, keyed by the dp-qualified id.
PEER_CACHES = ("_remote_agents", "layer_name_to_remote_kv_cache_metadata", "built_write_session",
               "remote_moriio_metadata", "_handshake_futures")  # fmt: skip
# ... and keyed by the bare engine id (``host:handshake_port``).
ENGINE_MARKS = ("_eager_handshaked_engines", "load_ready_flag", "write_ready_flags")
_NEEDED = (*PEER_CACHES, *ENGINE_MARKS, "_handshake_lock", "_record_failed_recv", "_eager_handshake_all_dp_ranks",
           "_invalid_block_ids", "start_load_kv")  # fmt: skip


def engine_of(dp_engine_id: str) -> str:
    """The bare remote engine id (``host:port``) of a dp- (and tp-) qualified one (``host:port_dp0[_tp1]``)."""
    return dp_engine_id.rsplit("_dp", 1)[0]


def bounded_zmq_ctx(original: Callable[[Any, str], Any], timeout_s: float) -> Callable[[Any, str], Any]:
    """``original`` (vLLM's ``zmq_ctx``), with a receive deadline on the DEALER sockets it makes.

    Only the handshake's initiator uses DEALER sockets; the listeners' ROUTER
    sockets, which wait for requests for as long as the server lives, keep
    blocking receives.
    """
    import zmq

    @contextlib.contextmanager
    def ctx(socket_type: Any, addr: str) -> Iterator[Any]:
        with original(socket_type, addr) as sock:
            if socket_type == zmq.DEALER:
                sock.setsockopt(zmq.RCVTIMEO, max(1, int(timeout_s * 1000)))
                sock.setsockopt(zmq.LINGER, 0)
            yield sock

    return ctx


class PeerCaches:
    """One MoRIIO worker's per-remote-engine caches, and what is done to them (items 2 and 3 above)."""

    def __init__(self, worker: Any, handshake_error: type[BaseException]) -> None:
        self.worker = worker
        self.handshake_error = handshake_error
        missing = [name for name in _NEEDED if not hasattr(worker, name)]
        self.known = not missing
        if missing:
            log.info("vLLM's MoRIIO worker lacks %s: failed peers are handled by vLLM alone", ", ".join(missing))
            return
        record, eager, load = worker._record_failed_recv, worker._eager_handshake_all_dp_ranks, worker.start_load_kv

        def record_then_forget(req_id: Any) -> None:
            record(req_id)
            self.forget_dead()

        def forget_then_load(metadata: Any) -> Any:
            # Before this step's reads: a peer that died or restarted since the last read is handshaken again
            # now, instead of failing one more request through its dead sessions first.
            if getattr(metadata, "reqs_to_recv", None):
                self.forget_dead()
            return load(metadata)

        def eager_per_engine(metadata: Any) -> None:
            self.handshake_each(eager, metadata)

        worker._record_failed_recv = record_then_forget
        worker._eager_handshake_all_dp_ranks = eager_per_engine
        worker.start_load_kv = forget_then_load

    def handshake_each(self, eager: Callable[[Any], None], metadata: Any) -> None:
        """vLLM's eager handshake, one remote engine at a time; an engine that fails fails its requests only."""
        by_engine: dict[str, dict[Any, Any]] = {}
        for req_id, meta in metadata.reqs_to_recv.items():
            by_engine.setdefault(f"{meta.remote_host}:{meta.remote_handshake_port}", {})[req_id] = meta
        for engine, reqs in by_engine.items():
            try:
                eager(SimpleNamespace(reqs_to_recv=reqs))
            except self.handshake_error:
                if getattr(self.worker, "_has_mamba", False):
                    raise  # vLLM's scheduler cannot recover hybrid loads: fail the step as vLLM does
                self.fail_loads(engine, reqs, metadata)

    def fail_loads(self, engine: str, reqs: dict[Any, Any], metadata: Any) -> None:
        """Take ``reqs`` out of this step's reads and report their blocks as not loaded."""
        blocks: set[int] = set()
        for req_id, meta in reqs.items():
            metadata.reqs_to_recv.pop(req_id, None)
            for group in meta.local_block_ids:
                blocks.update(group if isinstance(group, list | tuple) else [group])
        self.worker._invalid_block_ids.update(blocks)
        log.warning("handshake with remote engine %s failed: %d request(s) not loaded from it (%d blocks), "
                    "the server goes on", engine, len(reqs), len(blocks))  # fmt: skip

    def forget_dead(self) -> None:
        if not self.known:
            return
        sessions: dict[str, list[Any]] = self.worker.built_write_session
        dead = [eid for eid, ss in list(sessions.items()) if any(s is not None and not s.alive() for s in ss)]
        if not dead:
            return
        with self.worker._handshake_lock:
            for eid in dead:
                for name in PEER_CACHES:
                    getattr(self.worker, name).pop(eid, None)
                for name in ENGINE_MARKS:
                    marks = getattr(self.worker, name)
                    if isinstance(marks, set):
                        marks.discard(engine_of(eid))
                    else:
                        marks.pop(engine_of(eid), None)
        log.warning("remote engine(s) %s gone or restarted: their handshake is forgotten, the next request redoes it",
                    ", ".join(map(str, dead)))  # fmt: skip
