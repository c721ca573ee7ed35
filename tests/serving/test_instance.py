"""What a prefill and a decode instance share, in one process: peers and their sessions, control messages,
background tasks, the model thread and the accounting of requests."""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import threading
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import pytest
from prometheus_client import generate_latest

from moriio_async import IOEngine, IOEngineConfig
from moriio_async.serving.config import InstanceSettings, Role
from moriio_async.serving.instance import Instance, PeerUnavailable, ServingError, check_prompt
from moriio_async.serving.messages import ControlMessage, EngineRef, Release, WriteFailed, control_decoder
from moriio_async.serving.model import Model, ModelConfig

pytestmark = pytest.mark.timeout(60)

SMALL = ModelConfig(d_model=16, n_layers=2, n_heads=2, d_ff=32, block_size=4, max_model_len=32)
BLOCKS = 16


def settings(name: str, role: Role, **kw: float) -> InstanceSettings:
    return InstanceSettings(name, role, SMALL, BLOCKS, backend="mock", **kw)  # type: ignore[arg-type]


@dataclass
class Pair:
    a: Instance
    b: Instance

    @property
    def ref_b(self) -> EngineRef:
        return self.b.engine_ref()


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    a, b = Instance(settings("prefill-0", "prefill")), Instance(settings("decode-0", "decode"))
    await a.start()
    await b.start()
    p = Pair(a, b)
    try:
        yield p
    finally:
        await p.a.close()
        await p.b.close()  # the one a test may have put in b's place


def requests(inst: Instance, outcome: str) -> float | None:
    return inst.metrics.registry.get_sample_value("moriio_requests_total", {"outcome": outcome})


async def test_kv_is_refused_before_start_and_is_the_pools_array_after() -> None:
    inst = Instance(settings("prefill-0", "prefill"))
    with pytest.raises(RuntimeError, match="the instance is not started"):
        _ = inst.kv
    await inst.start()
    try:
        assert (inst.kv.name, inst.kv.engine_key, inst.kv.incarnation) == ("kv", "prefill-0", inst.engine.incarnation)
        assert inst.metrics.registry.get_sample_value("moriio_kv_blocks_free") == BLOCKS
        scrape = generate_latest(inst.metrics.registry).decode()
        assert "# HELP moriio_kv_blocks_free KV blocks of this instance by state\n" in scrape  # what /metrics says
        health = inst.health()
        assert (health.role, health.name, health.model) == ("prefill", "prefill-0", SMALL.name)
        assert health.fingerprint == SMALL.fingerprint() and health.layout == inst.pool.layout
        assert health.engine == EngineRef("prefill-0", inst.engine.address, inst.engine.incarnation)
        assert health.backend == inst.engine.backend_name  # no sessions yet
        assert health.blocks["free"] == BLOCKS and (health.requests_in_flight, health.requests_served) == (0, 0)
    finally:
        await inst.close()


async def test_the_engine_listens_where_the_settings_say_with_their_transfer_deadline() -> None:
    with socket.socket() as probe:  # a port free a moment ago
        probe.bind(("127.0.0.2", 0))
        port = probe.getsockname()[1]
    inst = Instance(
        InstanceSettings(
            "prefill-0",
            "prefill",
            SMALL,
            BLOCKS,
            backend="mock",
            host="127.0.0.2",
            engine_port=port,
            transfer_timeout=7.5,
            control_timeout=2.5,
        )
    )
    await inst.start()
    try:
        assert inst.engine.address == f"127.0.0.2:{port}" and inst.engine_ref().address == inst.engine.address
        assert (inst.engine.config.transfer_timeout, inst.engine.config.control_timeout) == (7.5, 2.5)
    finally:
        await inst.close()


async def test_start_logs_where_the_engine_listens_and_names_its_router(caplog: pytest.LogCaptureFixture) -> None:
    inst = Instance(settings("prefill-0", "prefill"))
    with caplog.at_level(logging.INFO, "moriio_async.serving"):
        await inst.start()
    try:
        said = f"prefill-0: engine {inst.engine.address} ({inst.engine.backend_name}), {BLOCKS} KV blocks"
        assert said in [r.getMessage() for r in caplog.records]
        names = {t.get_name() for t in asyncio.all_tasks() if not t.done()}
        assert "prefill-0-notifications" in names  # what a task dump shows
    finally:
        await inst.close()


async def test_a_session_is_reused_until_closed_and_a_fresh_one_follows(pair: Pair) -> None:
    first = await pair.a.session_to(pair.ref_b, "decode")
    assert await pair.a.session_to(pair.ref_b, "decode") is first
    assert first.remote.incarnation == pair.b.engine.incarnation
    assert pair.a.backend == "+".join(sorted(set(pair.a.engine.statistics().peer_transports.values())))
    await pair.a.close_session(pair.ref_b, first)
    assert first.closed
    second = await pair.a.session_to(pair.ref_b, "decode")
    assert second is not first and not second.closed
    await pair.a.close_session(pair.ref_b, first)  # an old session closed again leaves the current one alone
    assert await pair.a.session_to(pair.ref_b, "decode") is second


async def test_a_closed_session_is_replaced_without_close_session(pair: Pair) -> None:
    first = await pair.a.session_to(pair.ref_b, "decode")
    await first.close()
    second = await pair.a.session_to(pair.ref_b, "decode")
    assert second is not first and not second.closed


async def test_a_peer_that_restarted_gets_a_new_session_and_the_old_one_is_closed(
    pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "moriio_async.serving")
    old = await pair.a.session_to(pair.ref_b, "decode")  # the first meeting is no restart
    await pair.b.close()
    pair.b = Instance(settings("decode-0", "decode"))
    await pair.b.start()
    new_ref = pair.ref_b
    assert await pair.a.peer_gone(EngineRef("decode-0", new_ref.address, old.remote.incarnation))
    assert not await pair.a.peer_gone(new_ref)
    fresh = await pair.a.session_to(new_ref, "decode")
    assert fresh is not old and fresh.remote.incarnation == new_ref.incarnation
    for _ in range(100):
        if old.closed:
            break
        await asyncio.sleep(0.01)
    assert old.closed  # closed in the background: whatever was left on it is aborted
    said = f"prefill-0: decode-0 restarted (new incarnation {new_ref.incarnation:#x})"
    assert [r.getMessage() for r in caplog.records if "restarted" in r.getMessage()] == [said]


async def test_a_peer_at_an_address_is_checked_to_be_the_incarnation_named(pair: Pair) -> None:
    ref = pair.ref_b
    for wrong in (EngineRef(ref.key, ref.address, ref.incarnation + 1), EngineRef("decode-9", ref.address, 7)):
        with pytest.raises(PeerUnavailable) as info:
            await pair.a.connect_peer(wrong, "decode")
        err = info.value
        assert (err.status, err.retryable, err.cause) == (502, True, "decode")
        assert str(err) == (
            f"{ref.address} is decode-0 incarnation {ref.incarnation:#x}, "
            f"not {wrong.key} incarnation {wrong.incarnation:#x}: it restarted"
        )
        assert await pair.a.peer_gone(wrong)
    assert (await pair.a.connect_peer(ref, "decode")).engine.incarnation == ref.incarnation


async def test_a_peer_is_given_control_timeout_to_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    inst = Instance(settings("prefill-0", "prefill", control_timeout=0.25))
    asked: list[float] = []

    async def connect(address: str, timeout: float) -> None:
        asked.append(timeout)
        raise TimeoutError("no answer")

    monkeypatch.setattr(inst.engine, "connect", connect)
    with pytest.raises(PeerUnavailable, match=r"^cannot reach decode-0 at 127\.0\.0\.1:1: no answer$"):
        await inst.connect_peer(EngineRef("decode-0", "127.0.0.1:1", 1), "decode")
    assert asked == [0.25]


async def test_a_known_peer_is_not_asked_again(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    info = await pair.a.connect_peer(pair.ref_b, "decode")

    async def no_connect(*args: object, **kw: object) -> None:
        raise AssertionError("connected again to a known peer")

    monkeypatch.setattr(pair.a.engine, "connect", no_connect)
    assert await pair.a.connect_peer(pair.ref_b, "decode") is info


async def test_an_unreachable_peer_is_a_retryable_502_and_gone(pair: Pair) -> None:
    ref = pair.ref_b
    await pair.b.engine.close()
    with pytest.raises(PeerUnavailable) as info:
        await pair.a.session_to(ref, "prefill")
    err = info.value
    assert (err.status, err.retryable, err.cause) == (502, True, "prefill")
    assert str(err).startswith(f"cannot reach decode-0 at {ref.address}: ")
    assert await pair.a.peer_gone(ref)


async def test_peer_gone_waits_at_most_a_second_for_an_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    inst = Instance(settings("prefill-0", "prefill", control_timeout=30.0))
    asked: list[float] = []

    async def connect(address: str, timeout: float) -> None:
        asked.append(timeout)
        raise TimeoutError

    monkeypatch.setattr(inst.engine, "connect", connect)
    assert await inst.peer_gone(EngineRef("decode-0", "127.0.0.1:1", 1))
    short = Instance(settings("prefill-1", "prefill", control_timeout=0.25))
    monkeypatch.setattr(short.engine, "connect", connect)
    assert await short.peer_gone(EngineRef("decode-0", "127.0.0.1:1", 1))
    assert asked == [1.0, 0.25]


async def test_a_session_that_cannot_open_is_a_retryable_502(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    async def refused(*args: object) -> None:
        raise OSError("no pair")

    monkeypatch.setattr(pair.a.engine, "create_session", refused)
    with pytest.raises(PeerUnavailable) as info:
        await pair.a.session_to(pair.ref_b, "decode")
    assert str(info.value) == "cannot open a session to decode-0: no pair" and info.value.cause == "decode"


async def test_a_control_message_reaches_the_handler_of_its_type_with_the_senders_key(pair: Pair) -> None:
    got: asyncio.Queue[tuple[ControlMessage, str]] = asyncio.Queue()

    async def on_release(msg: Release, peer: str) -> None:
        await got.put((msg, peer))

    pair.b.handlers[Release] = on_release
    await pair.a.connect_peer(pair.ref_b, "decode")
    await pair.a.notify(pair.ref_b, Release("r1"))
    pair.a.notify_soon(pair.ref_b, Release("r2"))
    assert await asyncio.wait_for(got.get(), 10) == (Release("r1"), "prefill-0")
    assert await asyncio.wait_for(got.get(), 10) == (Release("r2"), "prefill-0")


async def test_malformed_and_unexpected_messages_are_dropped_with_a_warning(
    pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    got: asyncio.Queue[ControlMessage] = asyncio.Queue()

    async def on_release(msg: Release, peer: str) -> None:
        await got.put(msg)

    pair.b.handlers[Release] = on_release
    await pair.a.connect_peer(pair.ref_b, "decode")
    with caplog.at_level(logging.WARNING, "moriio_async.serving"):
        await pair.a.engine.notify("decode-0", b"not msgpack \xc1")
        await pair.a.notify(pair.ref_b, WriteFailed("r0", "no"))
        await pair.a.notify(pair.ref_b, Release("after"))
        assert await asyncio.wait_for(got.get(), 10) == Release("after")  # the router went on
    texts = [r.getMessage() for r in caplog.records]
    with pytest.raises(msgspec.DecodeError) as reason:
        control_decoder().decode(b"not msgpack \xc1")
    assert f"decode-0: malformed control message from prefill-0 dropped: {reason.value}" in texts
    assert "decode-0: unexpected WriteFailed from prefill-0 dropped" in texts


async def test_a_message_that_cannot_be_sent_soon_is_logged_not_raised(
    pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, "moriio_async.serving"):
        pair.a.notify_soon(EngineRef("decode-7", "127.0.0.1:1", 1), Release("r"))  # never connected
        for _ in range(200):
            if any("not delivered" in r.getMessage() for r in caplog.records):
                break
            await asyncio.sleep(0.01)
    texts = [r.getMessage() for r in caplog.records]
    assert any(t.startswith("prefill-0: Release to decode-7 not delivered: ") for t in texts)


async def test_the_log_of_a_message_not_delivered_says_why(
    pair: Pair, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def reset(key: str, data: bytes) -> None:
        raise OSError("connection reset by peer")

    monkeypatch.setattr(pair.a.engine, "notify", reset)
    with caplog.at_level(logging.INFO, "moriio_async.serving"):
        pair.a.notify_soon(pair.ref_b, WriteFailed("r", "no"))
        for _ in range(200):
            if any("not delivered" in r.getMessage() for r in caplog.records):
                break
            await asyncio.sleep(0.01)
    assert "prefill-0: WriteFailed to decode-0 not delivered: connection reset by peer" in [
        r.getMessage() for r in caplog.records
    ]


async def test_notify_gives_up_after_control_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    inst = Instance(settings("prefill-0", "prefill", control_timeout=0.05))

    async def stuck(key: str, data: bytes) -> None:
        await asyncio.sleep(30)

    monkeypatch.setattr(inst.engine, "notify", stuck)
    with pytest.raises(TimeoutError):
        await inst.notify(EngineRef("decode-0", "x", 1), Release("r"))


async def test_background_tasks_are_cancelled_at_close_and_failures_logged(caplog: pytest.LogCaptureFixture) -> None:
    inst = Instance(settings("prefill-0", "prefill"))
    await inst.start()

    async def fail() -> None:
        raise ValueError("boom")

    with caplog.at_level(logging.ERROR, "moriio_async.serving"):
        failed = inst.spawn(fail(), name="failing")
        await asyncio.wait([failed])
        await asyncio.sleep(0)
    assert failed.get_name() == "failing"
    record = next(r for r in caplog.records if r.getMessage() == "prefill-0: background task failed")
    assert record.exc_info is not None and isinstance(record.exc_info[1], ValueError)
    forever = inst.spawn(asyncio.sleep(3600))
    ok = inst.spawn(asyncio.sleep(0))
    await asyncio.wait([ok])
    with caplog.at_level(logging.ERROR, "moriio_async.serving"):
        caplog.clear()
        await inst.close()
    assert forever.cancelled() and not caplog.records  # neither a cancelled nor a finished task is an error


async def test_a_cancelled_task_cleans_up_before_the_engine_closes() -> None:
    """A task cut short at close may still need the engine for its cleanup (abort a session, tell a peer)."""
    inst = Instance(settings("prefill-0", "prefill"))
    await inst.start()
    engine_open_in_cleanup: list[bool] = []

    async def serve() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.01)  # a cleanup that itself waits (for a peer, a session's abort)
            engine_open_in_cleanup.append(not inst.engine.closed)

    inst.spawn(serve())
    await asyncio.sleep(0)  # serve is waiting
    await inst.close()
    assert engine_open_in_cleanup == [True]


async def test_an_instance_never_started_closes_and_its_model_thread_takes_no_more_work() -> None:
    """A server whose start failed still closes what it built."""
    inst = Instance(settings("prefill-0", "prefill"))
    await inst.close()
    with pytest.raises(RuntimeError, match="after shutdown"):
        await inst.compute(int)


async def test_a_finished_background_task_is_not_kept() -> None:
    """One task per control message sent soon or received: keeping them would grow without bound."""
    inst = Instance(settings("prefill-0", "prefill"))
    task = inst.spawn(asyncio.sleep(0))
    await asyncio.wait([task])
    await asyncio.sleep(0)  # its done callbacks run
    gone = weakref.ref(task)
    del task
    gc.collect()
    assert gone() is None


async def test_compute_runs_on_the_model_thread_and_a_cancelled_caller_waits_for_it() -> None:
    inst = Instance(settings("prefill-0", "prefill"))
    await inst.start()
    try:
        assert await inst.compute(lambda x: (threading.current_thread().name, x), 3) == ("prefill-0-model_0", 3)
        started, release, finished = threading.Event(), threading.Event(), threading.Event()

        def slow() -> None:
            started.set()
            release.wait(10)
            finished.set()

        caller = asyncio.create_task(inst.compute(slow))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
        caller.cancel()
        await asyncio.sleep(0.05)
        assert not caller.done()  # still waiting for slow to return
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert finished.is_set()
    finally:
        await inst.close()


async def test_the_model_runs_one_computation_at_a_time_on_one_thread() -> None:
    """Requests share one model thread: a second computation waits for the first instead of racing it."""
    inst = Instance(settings("prefill-0", "prefill"))
    started, release = threading.Event(), threading.Event()
    ran: list[str] = []

    def first() -> None:
        started.set()
        release.wait(10)
        ran.append(threading.current_thread().name)

    def second() -> None:
        ran.append(threading.current_thread().name)

    one = asyncio.create_task(inst.compute(first))
    await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
    two = asyncio.create_task(inst.compute(second))
    await asyncio.sleep(0)  # second is submitted while first runs
    release.set()
    await asyncio.gather(one, two)
    assert ran == ["prefill-0-model_0", "prefill-0-model_0"]
    await inst.close()


async def test_requests_are_counted_in_flight_and_by_outcome() -> None:
    inst = Instance(settings("prefill-0", "prefill"))
    gauge = inst.metrics.registry
    with inst.request():
        assert inst.requests_in_flight == 1 and gauge.get_sample_value("moriio_requests_in_flight") == 1
    with pytest.raises(PeerUnavailable), inst.request():
        raise PeerUnavailable("gone", "decode")
    with pytest.raises(ServingError), inst.request():
        raise ServingError(400, "bad prompt")
    with pytest.raises(KeyError), inst.request():
        raise KeyError("bug")
    assert inst.requests_in_flight == 0 and gauge.get_sample_value("moriio_requests_in_flight") == 0
    assert (requests(inst, "ok"), requests(inst, "decode"), requests(inst, "error")) == (1, 1, 2)
    assert inst.requests_served == 1


def test_a_prompt_is_one_to_max_model_len_ids_in_the_vocabulary() -> None:
    model = Model(SMALL)
    c = SMALL
    check_prompt(model, [0])
    check_prompt(model, [c.vocab - 1] * c.max_model_len)
    for bad in ([], [0] * (c.max_model_len + 1), [c.vocab], [-1]):
        with pytest.raises(ServingError) as info:
            check_prompt(model, bad)
        assert info.value.status == 400 and not info.value.retryable
        assert str(info.value) == f"prompt_token_ids must be 1..{c.max_model_len} ids in 0..{c.vocab - 1}"


def test_a_serving_error_is_not_retryable_unless_said() -> None:
    err = ServingError(503, "full", retryable=True, cause="capacity")
    assert (err.status, err.retryable, err.cause, str(err)) == (503, True, "capacity", "full")
    assert (ServingError(400, "x").retryable, ServingError(400, "x").cause) == (False, "")


async def test_an_engine_that_never_sends_kv_is_refused(pair: Pair) -> None:
    bare = await IOEngine("decode-1", IOEngineConfig(backend="mock")).start()
    try:
        ref = EngineRef(bare.key, bare.address, bare.incarnation)
        with pytest.raises(PeerUnavailable, match=r"^decode-1 exports no 'kv' region$"):
            await pair.a.session_to(ref, "decode")
    finally:
        await bare.close()
