"""The prefill server's READ mode, in one process: blocks lent to a reader, and how long a lease lasts."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
import pytest

from moriio_async import IOEngine, IOEngineConfig, TcpOptions
from moriio_async.backends.tcp import PlanHooks
from moriio_async.core.faultplan import Action, FaultPlan, FaultRule
from moriio_async.serving.config import InstanceSettings
from moriio_async.serving.instance import Instance, ServingError
from moriio_async.serving.kvpool import KVLayout
from moriio_async.serving.messages import (
    ControlMessage,
    EngineRef,
    PrefillRequest,
    Release,
    RemoteBlocks,
    WriteDone,
    WriteFailed,
    control_decoder,
    encode_control,
)
from moriio_async.serving.model import Model, ModelConfig
from moriio_async.serving.prefill import PrefillServer, busy_time, create_prefill_app

pytestmark = pytest.mark.timeout(60)

SMALL = ModelConfig(d_model=16, n_layers=2, n_heads=2, d_ff=32, block_size=4, max_model_len=32)
BLOCKS = 16
PROMPT = [1, 2, 3, 4, 5]  # two blocks of 4 tokens


async def test_lent_blocks_are_held_for_the_lease_timeout_then_go_back_to_the_pool(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A lease outlives every control deadline (a reader may take its whole transfer deadline, then abort);
    one never released expires after ``lease_timeout``, never before, and its blocks are free again."""
    settings = InstanceSettings(
        "prefill-0", "prefill", SMALL, BLOCKS, backend="mock", transfer_timeout=0.5, control_timeout=0.05
    )
    inst = Instance(settings)
    await inst.start()
    try:
        server = PrefillServer(inst)
        loop = asyncio.get_running_loop()
        lent_at = loop.time()
        answer = await server.prefill(PrefillRequest("r", PROMPT, "read"))
        lent = len(answer.block_ids)
        assert lent == 2 and inst.pool.stats()["in_flight"] == lent
        await asyncio.sleep(4 * settings.control_timeout)
        assert inst.pool.stats()["in_flight"] == lent, "past a control deadline the reader still holds them"
        while inst.pool.stats()["in_flight"]:
            assert loop.time() - lent_at < 10 * settings.lease_timeout, "the lease never expired"
            await asyncio.sleep(0.02)
        assert loop.time() - lent_at >= settings.lease_timeout
        assert inst.pool.stats()["free"] == BLOCKS and "r" not in server.leases
        warned = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "moriio_async.serving"]
        assert (logging.WARNING, "prefill-0: blocks of r never released; lease expired") in warned
    finally:
        await inst.close()


async def test_a_released_or_aborted_lease_frees_its_blocks_at_once() -> None:
    settings = InstanceSettings("prefill-0", "prefill", SMALL, BLOCKS, backend="mock")
    inst = Instance(settings)
    await inst.start()
    try:
        server = PrefillServer(inst)
        before = time.perf_counter()
        first = await server.prefill(PrefillRequest("a", PROMPT, "read"))
        assert 0 < first.stats.compute_s <= time.perf_counter() - before  # a duration, within the call
        await server.prefill(PrefillRequest("b", PROMPT, "read"))
        assert inst.pool.stats()["in_flight"] == 2 * len(first.block_ids)
        server.abort("a")
        assert inst.pool.stats()["in_flight"] == len(first.block_ids) and set(server.leases) == {"b"}
        server.abort("b")
        assert inst.pool.stats()["free"] == BLOCKS and not server.leases
    finally:
        await inst.close()


def test_busy_time_is_the_length_of_the_union_of_intervals() -> None:
    assert busy_time([]) == 0.0
    assert busy_time([(1.0, 3.0)]) == 2.0
    assert busy_time([(4.0, 6.0), (1.0, 3.0), (2.0, 5.0)]) == 5.0  # overlapping, out of order: 1..6
    assert busy_time([(1.0, 4.0), (2.0, 3.0)]) == 3.0  # one inside another
    assert busy_time([(0.0, 1.0), (2.0, 3.0)]) == 2.0  # a gap is not counted
    assert busy_time([(-3.0, -1.0), (-2.0, 0.0)]) == 3.0


@dataclass
class Stand:
    """A prefill server, and a bare engine in decode's place whose notifications the test reads."""

    server: PrefillServer
    decode: IOEngine
    ref: EngineRef
    layout: KVLayout
    cache: np.ndarray

    async def note(self) -> ControlMessage:
        return control_decoder().decode((await self.decode.recv_notification(timeout=10)).data)


@pytest.fixture
async def stand() -> AsyncIterator[Stand]:
    settings = InstanceSettings("prefill-0", "prefill", SMALL, BLOCKS, backend="mock", control_timeout=0.2)
    inst = Instance(settings)
    await inst.start()
    decode = await IOEngine("decode-0", IOEngineConfig(backend="mock")).start()
    cache = Model(SMALL).new_cache(BLOCKS)
    decode.register_memory(cache, name="kv")
    try:
        await decode.connect(inst.engine.address)  # as decode does before it offers blocks
        ref = EngineRef(decode.key, decode.address, decode.incarnation)
        yield Stand(PrefillServer(inst), decode, ref, KVLayout(SMALL.n_layers, BLOCKS, SMALL.block_bytes), cache)
    finally:
        await inst.close()
        await decode.close()


def offer(s: Stand, rid: str, block_ids: list[int]) -> RemoteBlocks:
    return RemoteBlocks(rid, block_ids, s.layout, s.ref)


async def test_a_write_lands_each_block_where_decode_asked_and_write_done_carries_the_first_token(stand: Stand) -> None:
    s = stand
    assert s.server.rendezvous.deliver(offer(s, "w", [9, 3])) == ""
    before = time.perf_counter()
    answer = await s.server.prefill(PrefillRequest("w", PROMPT, "write"))
    assert 0 < answer.stats.compute_s <= time.perf_counter() - before  # a duration, within the call
    note = await s.note()
    assert isinstance(note, WriteDone) and (note.request_id, note.first_token) == ("w", answer.first_token)
    sent, told = note.stats, answer.stats
    assert (sent.bytes, sent.transfer_s, sent.compute_s) == (told.bytes, told.transfer_s, told.compute_s)
    assert 0 <= sent.exposed_s <= told.exposed_s < told.compute_s + 10  # durations: the proxy's includes the send
    reference = Model(SMALL).new_cache(2)
    assert Model(SMALL).prefill(PROMPT, reference, [0, 1]) == answer.first_token
    assert np.array_equal(s.cache[:, :, [9, 3]], reference)
    assert not np.delete(s.cache, [9, 3], axis=2).any()
    assert answer.stats.bytes == SMALL.n_layers * 2 * 2 * SMALL.block_bytes and answer.stats.transfer_s > 0
    assert s.server.inst.pool.stats()["free"] == BLOCKS and s.server.inst.requests_served == 1
    registry = s.server.inst.metrics.registry
    for name, value in (("transfers_started", 2), ("transfers_succeeded", 2), ("transfer_bytes", answer.stats.bytes)):
        assert registry.get_sample_value(f"moriio_{name}_total", {"op": "write"}) == value  # a batch a layer


async def test_the_proxys_exposed_time_includes_sending_write_done(
    stand: Stand, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode waits for write_done, not for the bytes: the figure prefill answers the proxy with runs until
    write_done has left, so it exceeds the one write_done carries by at least the send's time."""
    s = stand
    real = s.server.inst.notify

    async def slow_notify(ref: EngineRef, msg: ControlMessage) -> None:
        await asyncio.sleep(0.06)  # a send that takes this long (0.01 s spare for a timer's early wake-up)
        await real(ref, msg)

    monkeypatch.setattr(s.server.inst, "notify", slow_notify)
    assert s.server.rendezvous.deliver(offer(s, "slow", [2, 5])) == ""
    answer = await s.server.prefill(PrefillRequest("slow", PROMPT, "write"))
    note = await s.note()
    assert isinstance(note, WriteDone)
    assert answer.stats.exposed_s >= note.stats.exposed_s + 0.05


@pytest.mark.parametrize(
    ("block_ids", "why"),
    [
        pytest.param([0], "decode offered 1 blocks for 2", id="too-few"),
        pytest.param([0, 1, 2], "decode offered 3 blocks for 2", id="too-many"),
        pytest.param([0, BLOCKS], "block ids must be distinct", id="outside-decodes-pool"),
        pytest.param([4, 4], "block ids must be distinct", id="repeated"),
    ],
)
async def test_blocks_decode_cannot_have_offered_are_a_400_and_write_failed_writing_nothing(
    stand: Stand, block_ids: list[int], why: str
) -> None:
    s = stand
    assert s.server.rendezvous.deliver(offer(s, "w", block_ids)) == ""
    with pytest.raises(ServingError) as info:
        await s.server.prefill(PrefillRequest("w", PROMPT, "write"))
    assert info.value.status == 400 and why in str(info.value) and not info.value.retryable
    note = await s.note()
    assert isinstance(note, WriteFailed) and note.request_id == "w" and why in note.error
    assert not s.cache.any() and s.server.inst.pool.stats()["free"] == BLOCKS


async def test_no_remote_blocks_in_time_is_a_retryable_504_blaming_decode(stand: Stand) -> None:
    s = stand
    with pytest.raises(ServingError) as info:
        await s.server.prefill(PrefillRequest("w", PROMPT, "write"))
    err = info.value
    assert (err.status, err.retryable, err.cause) == (504, True, "decode")
    assert str(err) == "no KV destination: decode sent no remote_blocks within 0.2s"
    assert s.server.inst.pool.stats()["free"] == BLOCKS


async def test_remote_blocks_for_an_aborted_request_are_answered_write_failed(stand: Stand) -> None:
    s = stand
    s.server.abort("gone")
    await s.decode.notify("prefill-0", encode_control(offer(s, "gone", [0, 1])))
    assert await s.note() == WriteFailed("gone", "the prefill request already ended")


async def test_a_full_pool_is_a_retryable_503_and_refuses_the_requests_blocks_later(stand: Stand) -> None:
    s = stand
    pool = s.server.inst.pool
    held = pool.try_allocate(BLOCKS)
    assert held is not None
    object.__setattr__(s.server.inst.settings, "admission_timeout", 0.01)  # frozen: the deadline this test shortens
    with pytest.raises(ServingError) as info:
        await s.server.prefill(PrefillRequest("w", PROMPT, "write"))
    assert (info.value.status, info.value.retryable, info.value.cause) == (503, True, "prefill")
    assert str(info.value) == "no 2 free KV blocks within 0.01s (0/16 free)"  # the pool's own words
    assert s.server.rendezvous.deliver(offer(s, "w", [0, 1])) == "the prefill request already ended"


async def test_release_from_the_reader_ends_the_lease_and_a_second_read_of_one_id_is_a_409(stand: Stand) -> None:
    s = stand
    pool = s.server.inst.pool
    await s.server.prefill(PrefillRequest("r", PROMPT, "read"))
    with pytest.raises(ServingError) as info:
        await s.server.prefill(PrefillRequest("r", PROMPT, "read"))
    assert info.value.status == 409 and pool.stats()["allocated"] == 2, "the second request's blocks are freed"
    assert str(info.value) == "request r already holds blocks here"
    await s.decode.notify("prefill-0", encode_control(Release("r")))
    while s.server.leases:  # noqa: ASYNC110 (polls the server's state: no event says a lease ended)
        await asyncio.sleep(0.005)
    assert pool.stats()["free"] == BLOCKS and pool.stats()["in_flight"] == 0


async def test_writes_that_cannot_be_posted_are_a_retryable_502_naming_why_and_write_failed(stand: Stand) -> None:
    """Decode's layout claims more blocks than its registered cache holds: each layer's post is refused
    (outside the peer's region), the request fails naming the refusal, and decode hears write_failed."""
    s = stand
    too_big = KVLayout(SMALL.n_layers, 4 * BLOCKS, SMALL.block_bytes)
    assert s.server.rendezvous.deliver(RemoteBlocks("w", [4 * BLOCKS - 2, 4 * BLOCKS - 1], too_big, s.ref)) == ""
    with pytest.raises(ServingError) as info:
        await s.server.prefill(PrefillRequest("w", PROMPT, "write"))
    err = info.value
    assert (err.status, err.retryable, err.cause) == (502, True, "decode")
    assert str(err).startswith("posting the KV writes failed: [") and "None" not in str(err)
    note = await s.note()
    assert isinstance(note, WriteFailed) and note.error.startswith("PeerUnavailable: posting the KV writes failed")
    assert not s.cache.any() and s.server.inst.pool.stats()["free"] == BLOCKS
    # Nothing was in flight: the session to decode, which other requests share, is not aborted.
    session = await s.server.inst.session_to(s.ref, cause="decode")
    assert session.statistics().state == "ready"


async def test_writes_that_time_out_close_both_halves_before_write_failed_and_the_stalled_write_lands_nowhere() -> None:
    """Decode's NIC stalls on the first write; prefill's wait times out. Prefill closes the session (its pair,
    and decode's half of it) before it tells decode write_failed, and fails the request as retryable, blaming
    decode. The stalled write, released once decode has heard write_failed, lands nowhere."""
    hooks = PlanHooks(FaultPlan((FaultRule(Action.STALL, qp=0, wr=0),)))
    settings = InstanceSettings("prefill-0", "prefill", SMALL, BLOCKS, backend="tcp", transfer_timeout=0.3)
    inst = Instance(settings)
    await inst.start()
    decode = await IOEngine("decode-0", IOEngineConfig(backend="tcp", tcp=TcpOptions(hooks=hooks))).start()
    cache = Model(SMALL).new_cache(BLOCKS)
    decode.register_memory(cache, name="kv")
    try:
        await decode.connect(inst.engine.address)
        s = Stand(PrefillServer(inst), decode, EngineRef(decode.key, decode.address, decode.incarnation),
                  KVLayout(SMALL.n_layers, BLOCKS, SMALL.block_bytes), cache)  # fmt: skip
        assert s.server.rendezvous.deliver(offer(s, "w", [0, 1])) == ""
        with pytest.raises(ServingError) as info:
            await s.server.prefill(PrefillRequest("w", PROMPT, "write"))
        err = info.value
        assert (err.status, err.retryable, err.cause) == (502, True, "decode")
        assert str(err).startswith("KV writes to decode failed: ")
        note = await s.note()
        assert isinstance(note, WriteFailed) and note.error.startswith("PeerUnavailable: KV writes to decode failed")
        heard = cache.copy()  # decode may reuse its blocks from here: nothing may land in them any more
        hooks.release()
        registry = inst.metrics.registry

        def count(name: str) -> float:
            return registry.get_sample_value(f"moriio_transfers_{name}_total", {"op": "write"}) or 0.0

        assert count("timed_out") >= 1, "the stalled write is counted as past its deadline"
        assert count("timed_out") + count("succeeded") == count("started") == 2
        assert [a.action for a in hooks.applied] == [Action.STALL]
        assert inst.pool.stats()["free"] == BLOCKS
        # The session was closed: the next transfer goes over a fresh pair (the stall held only the first
        # pair's first request), and the released write did not land in the meantime.
        session = await inst.session_to(s.ref, cause="decode")
        last = s.layout.offset(0, 0, BLOCKS - 1)
        await asyncio.wait_for(session.write(0, last, 1), 10)
        await asyncio.sleep(0.2)  # room for the released write to land, were it to
        now, then = cache.view(np.uint8).ravel(), heard.view(np.uint8).ravel()
        then[last] = now[last]  # the one byte written since, on purpose
        assert np.array_equal(now, then), "the stalled write landed after decode heard write_failed"
    finally:
        hooks.release()
        await inst.close()
        await decode.close()


async def test_four_offers_a_block_may_wait_for_their_request_and_the_next_is_refused(stand: Stand) -> None:
    s = stand
    for i in range(4 * BLOCKS):  # no await in between: none of them can expire meanwhile
        assert s.server.rendezvous.deliver(offer(s, f"w{i}", [0, 1])) == ""
    assert s.server.rendezvous.deliver(offer(s, "one-too-many", [0, 1])) == "too many requests waiting for their blocks"


async def test_a_decode_exporting_no_kv_is_a_retryable_502_blaming_decode(stand: Stand) -> None:
    s = stand
    bare = await IOEngine("decode-1", IOEngineConfig(backend="mock")).start()
    try:
        await bare.connect(s.server.inst.engine.address)
        ref = EngineRef(bare.key, bare.address, bare.incarnation)
        assert s.server.rendezvous.deliver(RemoteBlocks("w", [0, 1], s.layout, ref)) == ""
        with pytest.raises(ServingError) as info:
            await s.server.prefill(PrefillRequest("w", PROMPT, "write"))
        err = info.value
        assert (err.status, err.retryable, err.cause) == (502, True, "decode")
        assert str(err) == "decode-1 exports no 'kv' region"
        assert s.server.inst.pool.stats()["free"] == BLOCKS
    finally:
        await bare.close()


async def test_a_write_done_that_cannot_be_sent_is_a_retryable_502_blaming_decode(
    stand: Stand, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The KV is in decode's blocks but decode cannot be told: the request fails (the proxy tries again)."""
    s = stand
    assert s.server.rendezvous.deliver(offer(s, "w", [0, 1])) == ""

    async def unreachable(ref: EngineRef, msg: ControlMessage) -> None:
        raise OSError("connection reset by peer")

    monkeypatch.setattr(s.server.inst, "notify", unreachable)
    with pytest.raises(ServingError) as info:
        await s.server.prefill(PrefillRequest("w", PROMPT, "write"))
    err = info.value
    assert (err.status, err.retryable, err.cause) == (502, True, "decode")
    assert str(err) == "write_done not delivered: connection reset by peer"
    assert s.server.inst.pool.stats()["free"] == BLOCKS


def test_the_prefill_app_is_titled_by_its_role_and_name() -> None:
    app = create_prefill_app(InstanceSettings("prefill-0", "prefill", SMALL, BLOCKS, backend="mock"))
    assert app.title == "moriio_async prefill prefill-0"  # what /docs and /openapi.json call it


async def test_a_read_mode_compute_that_fails_frees_its_blocks_and_lends_nothing(
    stand: Stand, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = stand

    def broken_prefill(*_args: object) -> int:
        raise RuntimeError("the model thread broke")

    monkeypatch.setattr(s.server.inst.model, "prefill", broken_prefill)
    with pytest.raises(RuntimeError, match="the model thread broke"):
        await s.server.prefill(PrefillRequest("r", PROMPT, "read"))
    assert s.server.inst.pool.stats()["free"] == BLOCKS and not s.server.leases
