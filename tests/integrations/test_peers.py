"""integrations.peers: bounded handshakes, a failed handshake failing its requests only, dead peers forgotten."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from moriio_async.integrations.peers import PeerCaches, bounded_zmq_ctx, engine_of


class HandshakeError(Exception):
    pass


class Session:
    def __init__(self, alive: bool) -> None:
        self.is_alive = alive

    def alive(self) -> bool:
        return self.is_alive


def meta(host: str, port: int, blocks: list[int]) -> SimpleNamespace:
    return SimpleNamespace(remote_host=host, remote_handshake_port=port, local_block_ids=[blocks])


class FakeWorker:
    """The names of vLLM 0.32's MoRIIOConnectorWorker that PeerCaches reads and wraps."""

    def __init__(self, failing: set[str] | None = None) -> None:
        self.failing = failing or set()
        self._remote_agents: dict[str, Any] = {}
        self.layer_name_to_remote_kv_cache_metadata: dict[str, Any] = {}
        self.built_write_session: dict[str, list[Any]] = {}
        self.remote_moriio_metadata: dict[str, Any] = {}
        self._handshake_futures: dict[str, Any] = {}
        self._eager_handshaked_engines: set[str] = set()
        self.load_ready_flag: dict[str, bool] = {}
        self.write_ready_flags: dict[str, bool] = {}
        self._handshake_lock = threading.Lock()
        self._invalid_block_ids: set[int] = set()
        self.recorded: list[str] = []
        self.eager_calls: list[list[str]] = []
        self.loaded: list[list[str]] = []

    def _record_failed_recv(self, req_id: str) -> None:
        self.recorded.append(req_id)

    def _eager_handshake_all_dp_ranks(self, metadata: Any) -> None:
        engines = sorted({f"{m.remote_host}:{m.remote_handshake_port}" for m in metadata.reqs_to_recv.values()})
        self.eager_calls.append(engines)
        for engine in engines:
            if engine in self.failing:
                raise HandshakeError(engine)
            self._eager_handshaked_engines.add(engine)
            self._remote_agents[f"{engine}_dp0"] = {"agent"}

    def start_load_kv(self, metadata: Any) -> None:
        self._eager_handshake_all_dp_ranks(metadata)
        self.loaded.append(sorted(metadata.reqs_to_recv))

    def know(self, engine: str, alive: bool) -> None:
        eid = f"{engine}_dp0"
        for cache in (self._remote_agents, self.layer_name_to_remote_kv_cache_metadata, self.remote_moriio_metadata):
            cache[eid] = object()
        self.built_write_session[eid] = [Session(alive), Session(True)]
        self._eager_handshaked_engines.add(engine)
        self.load_ready_flag[engine] = self.write_ready_flags[engine] = True


def test_engine_of_strips_the_dp_and_tp_qualifiers() -> None:
    assert engine_of("10.0.0.1:7000_dp3") == "10.0.0.1:7000"
    assert engine_of("10.0.0.1:7000_dp0_tp1") == "10.0.0.1:7000"


def test_a_failed_handshake_fails_the_requests_of_that_engine_only_and_the_step_goes_on() -> None:
    worker = FakeWorker(failing={"h:2"})
    PeerCaches(worker, HandshakeError)
    reqs = {"a": meta("h", 1, [1, 2]), "b": meta("h", 2, [3, 4]), "c": meta("h", 2, [5]), "d": meta("h", 3, [6])}
    worker.start_load_kv(SimpleNamespace(reqs_to_recv=reqs))
    assert worker.loaded == [["a", "d"]]  # the reads of this step: the requests of engines that answered
    assert worker._invalid_block_ids == {3, 4, 5}  # the scheduler recomputes (or fails) these, nothing else
    assert worker._eager_handshaked_engines == {"h:1", "h:3"}
    assert worker.eager_calls[0] == ["h:1"] and ["h:3"] in worker.eager_calls  # one engine per call


def test_a_hybrid_model_still_fails_the_step_as_vllm_does() -> None:
    worker = FakeWorker(failing={"h:2"})
    worker._has_mamba = True  # type: ignore[attr-defined]
    PeerCaches(worker, HandshakeError)
    with pytest.raises(HandshakeError):
        worker.start_load_kv(SimpleNamespace(reqs_to_recv={"b": meta("h", 2, [3])}))


def test_a_dead_peer_is_forgotten_entirely_before_the_next_reads() -> None:
    worker = FakeWorker()
    PeerCaches(worker, HandshakeError)
    worker.know("h:1", alive=False)
    worker.know("h:9", alive=True)
    worker.start_load_kv(SimpleNamespace(reqs_to_recv={"a": meta("h", 1, [1])}))
    # h:1 was forgotten (every cache and mark), then handshaken again by this very step; h:9 kept
    assert worker.eager_calls == [["h:1"]] and worker.loaded == [["a"]]
    assert "h:1_dp0" not in worker.built_write_session and "h:1" not in worker.load_ready_flag
    assert "h:9_dp0" in worker.built_write_session and "h:9" in worker._eager_handshaked_engines


def test_a_failed_read_forgets_the_dead_peer_after_vllm_recorded_it() -> None:
    worker = FakeWorker()
    PeerCaches(worker, HandshakeError)
    worker.know("h:1", alive=False)
    worker._record_failed_recv("r")
    assert worker.recorded == ["r"]
    assert "h:1" not in worker._eager_handshaked_engines and "h:1_dp0" not in worker._remote_agents


def test_a_worker_without_the_known_names_is_left_alone() -> None:
    worker = SimpleNamespace(_record_failed_recv=lambda r: None)
    caches = PeerCaches(worker, HandshakeError)
    assert not caches.known
    caches.forget_dead()  # a no-op


def test_a_handshake_socket_gets_a_receive_deadline_and_a_listener_keeps_blocking() -> None:
    import zmq  # the test extra installs pyzmq (vLLM brings its own)

    made: list[Any] = []

    @contextlib.contextmanager
    def original(socket_type: Any, addr: str) -> Iterator[Any]:
        ctx = zmq.Context()
        sock = ctx.socket(socket_type)
        made.append(sock)
        try:
            yield sock
        finally:
            ctx.destroy(linger=0)

    bounded = bounded_zmq_ctx(original, 0.05)
    with bounded(zmq.DEALER, "tcp://127.0.0.1:1") as sock:
        assert sock.getsockopt(zmq.RCVTIMEO) == 50
        sock.connect("tcp://127.0.0.1:1")  # nothing listens: vLLM's recv would wait for ever
        with pytest.raises(zmq.Again):
            sock.recv_multipart()
    with bounded(zmq.ROUTER, "tcp://127.0.0.1:1") as sock:
        assert sock.getsockopt(zmq.RCVTIMEO) == -1
