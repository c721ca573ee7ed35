"""The decode server's READ mode, in one process: a decode ``Instance`` reading from a stand-in prefill.

The stand-in is a plain ``IOEngine`` exporting a cache shaped like a prefill
pool, every byte of it non-zero, so a read that should not have happened shows
up in the decode pool's bytes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import msgspec
import numpy as np
import pytest
from starlette.types import Message, Scope

from moriio_async import IOEngine, IOEngineConfig, TcpOptions
from moriio_async.backends.tcp import PlanHooks
from moriio_async.core.faultplan import Action, FaultPlan, FaultRule
from moriio_async.serving.config import InstanceSettings, Role
from moriio_async.serving.decode import DecodeServer, Generation, create_decode_app
from moriio_async.serving.instance import Instance, ServingError
from moriio_async.serving.kvpool import KVLayout
from moriio_async.serving.messages import (
    EngineRef,
    GenerateRequest,
    Mode,
    PrefillRequest,
    Release,
    RemoteBlocks,
    TokenLine,
    TransferStats,
    WriteDone,
    WriteFailed,
    control_decoder,
)
from moriio_async.serving.model import Model, ModelConfig, encode
from moriio_async.serving.prefill import PrefillServer

pytestmark = pytest.mark.timeout(60)

SMALL = ModelConfig(d_model=16, n_layers=2, n_heads=2, d_ff=32, block_size=4, max_model_len=32)
BLOCKS = 16
PROMPT = [1, 2, 3, 4, 5]  # two blocks of 4 tokens
ROLES: tuple[Role, Role] = ("prefill", "decode")


@dataclass
class Stand:
    decode: DecodeServer
    prefill: IOEngine
    ref: EngineRef
    layout: KVLayout
    cache: np.ndarray


async def stand(backend: str, *, transfer_timeout: float = 10.0, hooks: PlanHooks | None = None) -> Stand:
    prefill = await IOEngine("prefill-0", IOEngineConfig(backend=backend, tcp=TcpOptions(hooks=hooks))).start()
    cache = Model(SMALL).new_cache(BLOCKS)
    cache.view(np.uint8)[...] = 0xA5  # every byte non-zero: a stray read cannot hide
    prefill.register_memory(cache, name="kv")
    settings = InstanceSettings(
        "decode-0", "decode", SMALL, BLOCKS, backend=backend, transfer_timeout=transfer_timeout, control_timeout=5.0
    )
    inst = Instance(settings)
    await inst.start()
    layout = KVLayout(SMALL.n_layers, BLOCKS, SMALL.block_bytes)
    ref = EngineRef(prefill.key, prefill.address, prefill.incarnation)
    return Stand(DecodeServer(inst), prefill, ref, layout, cache)


async def close(s: Stand) -> None:
    await s.decode.inst.close()
    await s.prefill.close()


def sample(s: Stand, counter: str, op: str) -> float:
    """A decode instance's transfer counter, by op."""
    name = "moriio_transfer_bytes_total" if counter == "bytes" else f"moriio_transfers_{counter}_total"
    return s.decode.inst.metrics.registry.get_sample_value(name, {"op": op}) or 0.0


def read_request(s: Stand, block_ids: list[int], request_id: str = "r1") -> GenerateRequest:
    return GenerateRequest(request_id, PROMPT, 1, "read", s.ref, first_token=7, block_ids=block_ids, layout=s.layout)


@pytest.fixture
async def mock_stand() -> AsyncIterator[Stand]:
    s = await stand("mock")
    try:
        yield s
    finally:
        await close(s)


@pytest.mark.parametrize(
    "block_ids",
    [
        pytest.param([3, BLOCKS], id="id-equal-to-num_blocks"),  # would be block 0 of the next K/V plane
        pytest.param([BLOCKS - 1, BLOCKS], id="last-and-num_blocks"),
        pytest.param([4, 4], id="repeated-id"),
        pytest.param([-1, 2], id="negative-id"),
    ],
)
async def test_a_read_naming_a_block_outside_prefills_pool_or_twice_is_refused_and_reads_nothing(
    mock_stand: Stand, block_ids: list[int]
) -> None:
    s = mock_stand
    pool = s.decode.inst.pool
    with pytest.raises(ServingError) as info:
        await s.decode.generate(read_request(s, block_ids))
    assert info.value.status == 400 and "block ids" in str(info.value)
    assert not pool.array.view(np.uint8).any()  # not one byte of prefill's cache arrived
    assert pool.stats()["free"] == BLOCKS and pool.stats()["in_flight"] == 0
    # The same request with good ids reads exactly its blocks.
    gen, stats = await s.decode.generate(read_request(s, [0, 5], "r2"))
    await asyncio.wait_for(gen.task, 10)
    assert stats.bytes == SMALL.n_layers * 2 * 2 * SMALL.block_bytes
    assert stats.exposed_s == stats.transfer_s > 0  # READ: the reads are all of the handoff
    counts = {name: sample(s, name, "read") for name in ("started", "succeeded", "failed", "timed_out", "bytes")}
    assert counts == {
        "started": 2,
        "succeeded": 2,
        "failed": 0,
        "timed_out": 0,
        "bytes": stats.bytes,
    }  # a batch a layer
    assert (pool.array[:, :, :2].view(np.uint8) == 0xA5).all()


async def test_reads_that_time_out_are_aborted_before_their_blocks_are_reused() -> None:
    """Prefill's NIC stalls on the first read; decode's wait times out. Before the blocks go back to the pool
    the session is aborted, so when prefill answers at last nothing lands in the blocks reallocated since."""
    hooks = PlanHooks(FaultPlan((FaultRule(Action.STALL, qp=None, wr=0),)))
    s = await stand("tcp", transfer_timeout=0.3, hooks=hooks)
    try:
        pool = s.decode.inst.pool
        with pytest.raises(ServingError) as info:
            await s.decode.generate(read_request(s, [0, 1]))
        assert (info.value.status, info.value.cause) == (502, "prefill") and "failed" in str(info.value)
        assert sample(s, "timed_out", "read") >= 1, "the stalled read is counted as past its deadline"
        assert sample(s, "timed_out", "read") + sample(s, "succeeded", "read") == sample(s, "started", "read") == 2
        assert [a.action for a in hooks.applied] == [Action.STALL]  # the stall held the read, not a refusal
        # Prefill hears release also after a failed read: its lease ends now, not at its timeout.
        note = await s.prefill.recv_notification(timeout=10)
        assert note.peer == "decode-0" and control_decoder().decode(note.data) == Release("r1")
        again = pool.try_allocate(pool.num_blocks)  # every block, those the reads were aimed at included
        assert again is not None
        hooks.release()  # prefill's NIC answers the stalled read now
        # A pair completes in order: one more read over the session ends after the stalled one would have
        # landed, had the session kept its pair (after the abort it reads over a fresh one).
        session = await s.decode.inst.session_to(s.ref, cause="prefill")
        last = pool.num_blocks - 1
        await session.read(s.layout.offset(0, 0, last), s.layout.offset(0, 0, 0), 1)
        assert not pool.array[:, :, : pool.num_blocks - 1].view(np.uint8).any()
        pool.free(again)
    finally:
        hooks.release()
        await close(s)


async def test_a_read_timing_out_behind_one_that_succeeded_is_aborted_before_the_blocks_are_reused() -> None:
    """Prefill's NIC answers the first layer's read and stalls the second: one read is still pending at the
    deadline, which is enough to abort the session before the blocks go back to the pool."""
    hooks = PlanHooks(FaultPlan((FaultRule(Action.STALL, qp=None, wr=2),)))  # the second layer's first request
    s = await stand("tcp", transfer_timeout=0.3, hooks=hooks)
    try:
        pool = s.decode.inst.pool
        with pytest.raises(ServingError) as info:
            await s.decode.generate(read_request(s, [0, 1]))
        assert (info.value.status, info.value.cause) == (502, "prefill")
        assert (sample(s, "succeeded", "read"), sample(s, "timed_out", "read")) == (1, 1)
        again = pool.try_allocate(pool.num_blocks)
        assert again is not None
        pool.array.view(np.uint8)[...] = 0  # what the first read landed: gone; only a late read could refill it
        hooks.release()
        session = await s.decode.inst.session_to(s.ref, cause="prefill")
        last = pool.num_blocks - 1
        await session.read(s.layout.offset(0, 0, last), s.layout.offset(0, 0, 0), 1)  # after it, in pair order
        assert not pool.array[:, :, : pool.num_blocks - 1].view(np.uint8).any()
        pool.free(again)
    finally:
        hooks.release()
        await close(s)


async def test_a_request_cancelled_while_its_reads_are_in_flight_aborts_them_and_frees_every_block() -> None:
    """The request's task is cancelled (its client went away) while prefill's NIC stalls a read: the session
    is aborted, prefill hears release, and every block the request allocated goes back to the pool."""
    hooks = PlanHooks(FaultPlan((FaultRule(Action.STALL, qp=None, wr=0),)))
    s = await stand("tcp", hooks=hooks)
    try:
        pool = s.decode.inst.pool
        task = asyncio.create_task(s.decode.generate(read_request(s, [0, 1])))
        while not hooks.applied:  # noqa: ASYNC110 (polls the NIC's hooks: no event says the read stalls)
            await asyncio.sleep(0.005)
        assert pool.stats()["free"] < BLOCKS
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert pool.stats()["free"] == BLOCKS and pool.stats()["in_flight"] == 0
        note = await s.prefill.recv_notification(timeout=10)
        assert note.peer == "decode-0" and control_decoder().decode(note.data) == Release("r1")
    finally:
        hooks.release()
        await close(s)


# -- WRITE mode: a prefill and a decode instance in one process ----------------------------------------


@dataclass
class Pair:
    prefill: PrefillServer
    decode: DecodeServer


@pytest.fixture
async def write_pair() -> AsyncIterator[Pair]:
    insts = [Instance(InstanceSettings(f"{role}-0", role, SMALL, BLOCKS, backend="mock")) for role in ROLES]
    for inst in insts:
        await inst.start()
    try:
        yield Pair(PrefillServer(insts[0]), DecodeServer(insts[1]))
    finally:
        for inst in insts:
            await inst.close()


async def tokens_of(gen: Generation) -> tuple[list[int], str]:
    lines = [msgspec.json.decode(line, type=TokenLine) async for line in gen.lines()]
    *tokens, end = lines
    return [t.token for t in tokens if t.token is not None], end.finish_reason or ""


async def test_a_write_mode_request_generates_the_reference_and_gives_every_block_back(write_pair: Pair) -> None:
    """Prefill writes the prompt's KV into the blocks decode offered and answers write_done with the first token;
    decode then generates token for token what one process generates. After it, both pools are whole again."""
    p, d = write_pair.prefill, write_pair.decode
    prompt = encode("kv by write")
    gen_req = GenerateRequest("w1", prompt, 6, "write", p.inst.engine_ref())
    (gen, d_stats), answer = await asyncio.gather(d.generate(gen_req), p.prefill(PrefillRequest("w1", prompt, "write")))
    reference = Model(SMALL).generate(prompt, 6)
    assert answer.first_token == reference[0] and answer.engine == p.inst.engine_ref()
    n_blocks = SMALL.blocks_for(len(prompt))
    assert d_stats.bytes == answer.stats.bytes == SMALL.n_layers * 2 * n_blocks * SMALL.block_bytes
    assert answer.stats.compute_s > 0 and answer.stats.exposed_s >= 0
    assert await tokens_of(gen) == (reference, "length")
    await asyncio.wait_for(gen.task, 10)
    for inst in (p.inst, d.inst):
        assert inst.pool.stats()["free"] == BLOCKS and inst.pool.stats()["in_flight"] == 0
    assert not d.waiters and len(p.rendezvous) == 0


async def test_write_blocks_nobody_prefills_come_back_as_write_failed_and_a_retryable_502() -> None:
    """Decode offers its blocks, no prefill request claims them: at the rendezvous's ttl prefill answers
    write_failed, and decode frees the blocks and fails the request as retryable, blaming prefill."""
    insts = [
        Instance(InstanceSettings(f"{role}-0", role, SMALL, BLOCKS, backend="mock", control_timeout=0.2))
        for role in ROLES
    ]
    for inst in insts:
        await inst.start()
    try:
        p, d = PrefillServer(insts[0]), DecodeServer(insts[1])
        with pytest.raises(ServingError) as info:
            await d.generate(GenerateRequest("lost", PROMPT, 2, "write", p.inst.engine_ref()))
        err = info.value
        assert (err.status, err.retryable, err.cause) == (502, True, "prefill")
        assert str(err) == "prefill-0 could not write the KV: no prefill request claimed these blocks in time"
        assert d.inst.pool.stats()["free"] == BLOCKS and d.inst.pool.stats()["in_flight"] == 0 and not d.waiters
    finally:
        for inst in insts:
            await inst.close()


async def test_an_aborted_write_request_frees_its_blocks_only_once_prefill_answered(write_pair: Pair) -> None:
    """The proxy aborts both legs before decode asks: prefill is alive, so decode waits for its answer
    (write_failed: the request already ended there) before its blocks go back to the pool."""
    p, d = write_pair.prefill, write_pair.decode
    p.abort("gone")
    d.abort("gone")
    with pytest.raises(ServingError) as info:
        await d.generate(GenerateRequest("gone", PROMPT, 2, "write", p.inst.engine_ref()))
    assert info.value.status == 502 and str(info.value).endswith("the prefill request already ended")
    assert d.inst.pool.stats()["free"] == BLOCKS and not d.waiters


async def test_a_second_write_request_under_a_waiting_id_is_a_409(write_pair: Pair) -> None:
    p, d = write_pair.prefill, write_pair.decode
    first = asyncio.create_task(d.generate(GenerateRequest("twice", PROMPT, 2, "write", p.inst.engine_ref())))
    while "twice" not in d.waiters:  # noqa: ASYNC110 (polls decode's state: no event says it waits)
        await asyncio.sleep(0.005)
    with pytest.raises(ServingError) as info:
        await d.generate(GenerateRequest("twice", PROMPT, 2, "write", p.inst.engine_ref()))
    assert info.value.status == 409 and "already waiting for its KV" in str(info.value)
    await p.prefill(PrefillRequest("twice", PROMPT, "write"))
    gen, _ = await first
    assert (await tokens_of(gen))[1] == "length"
    await asyncio.wait_for(gen.task, 10)
    assert d.inst.pool.stats()["free"] == BLOCKS


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "why"),
    [
        pytest.param([], 2, "prompt_token_ids must be 1..32 ids", id="empty-prompt"),
        pytest.param(PROMPT, 0, "max_tokens 0 must be >= 1 and fit in max_model_len", id="no-tokens"),
        pytest.param(
            PROMPT, SMALL.max_model_len - len(PROMPT) + 1, "max_tokens 28 must be >= 1", id="past-max_model_len"
        ),
    ],
)
async def test_a_request_that_cannot_fit_is_a_400_and_allocates_nothing(
    mock_stand: Stand, prompt: list[int], max_tokens: int, why: str
) -> None:
    s = mock_stand
    req = GenerateRequest("r", prompt, max_tokens, "read", s.ref, first_token=7, block_ids=[0, 1], layout=s.layout)
    with pytest.raises(ServingError) as info:
        await s.decode.generate(req)
    assert info.value.status == 400 and str(info.value).startswith(why)
    assert s.decode.inst.pool.stats()["allocated"] == 0 and s.decode.inst.pool.peak == 0


async def test_a_request_filling_max_model_len_exactly_is_served(mock_stand: Stand) -> None:
    s = mock_stand
    max_tokens = SMALL.max_model_len - len(PROMPT)
    req = GenerateRequest("r", PROMPT, max_tokens, "read", s.ref, first_token=7, block_ids=[0, 1], layout=s.layout)
    gen, _ = await s.decode.generate(req)
    assert s.decode.inst.pool.peak == SMALL.blocks_for(SMALL.max_model_len)
    tokens, reason = await tokens_of(gen)
    assert len(tokens) == max_tokens and tokens[0] == 7 and reason == "length"


async def test_a_read_request_missing_prefills_answer_is_a_400_that_frees_its_blocks(mock_stand: Stand) -> None:
    s = mock_stand
    for req in (
        GenerateRequest("r", PROMPT, 1, "read", s.ref, first_token=7, block_ids=[0, 1]),
        GenerateRequest("r", PROMPT, 1, "read", s.ref, block_ids=[0, 1], layout=s.layout),
        GenerateRequest("r", PROMPT, 1, "read", s.ref, first_token=7, block_ids=[0], layout=s.layout),
    ):
        with pytest.raises(ServingError) as info:
            await s.decode.generate(req)
        assert info.value.status == 400 and str(info.value).startswith("READ mode needs prefill's layout")
        assert s.decode.inst.pool.stats()["free"] == BLOCKS


async def test_a_full_pool_is_a_retryable_503_blaming_decode() -> None:
    s = await stand("mock")
    try:
        pool = s.decode.inst.pool
        held = pool.try_allocate(BLOCKS)
        assert held is not None
        settings = s.decode.inst.settings
        object.__setattr__(settings, "admission_timeout", 0.01)  # frozen: the one deadline this test shortens
        with pytest.raises(ServingError) as info:
            await s.decode.generate(read_request(s, [0, 1]))
        assert (info.value.status, info.value.retryable, info.value.cause) == (503, True, "decode")
        assert str(info.value) == "no 2 free KV blocks within 0.01s (0/16 free)"  # the pool's own words
    finally:
        await close(s)


async def test_a_generation_closed_before_it_ran_still_frees_its_blocks(mock_stand: Stand) -> None:
    s = mock_stand
    gen, _ = await s.decode.generate(read_request(s, [0, 5]))
    gen.close()
    with pytest.raises(asyncio.CancelledError):
        await gen.task
    assert s.decode.inst.pool.stats()["free"] == BLOCKS


async def test_an_abort_while_waiting_for_a_prefill_that_died_frees_the_blocks_at_once() -> None:
    """Prefill took decode's blocks and died; the proxy's abort wakes decode, which finds prefill gone and
    fails the request instead of waiting out its write wait (50 s here)."""
    insts = [Instance(InstanceSettings(f"{role}-0", role, SMALL, BLOCKS, backend="mock")) for role in ROLES]
    for inst in insts:
        await inst.start()
    try:
        p, d = PrefillServer(insts[0]), DecodeServer(insts[1])
        waiting = asyncio.create_task(d.generate(GenerateRequest("w", PROMPT, 2, "write", p.inst.engine_ref())))
        while len(p.rendezvous) == 0:  # noqa: ASYNC110 (polls prefill's state: remote_blocks arrived)
            await asyncio.sleep(0.005)
        await p.inst.close()
        d.abort("w")
        with pytest.raises(ServingError) as info:
            await asyncio.wait_for(waiting, 10)
        assert info.value.status == 502 and str(info.value).endswith("prefill-0 is gone")
        assert d.inst.pool.stats()["free"] == BLOCKS and not d.waiters
    finally:
        await insts[1].close()


async def test_aborts_are_remembered_for_a_write_wait_and_at_most_four_per_block(mock_stand: Stand) -> None:
    """An abort may come before its request, so decode remembers it: for one write wait, and a bounded number."""
    d = mock_stand.decode
    settings = d.inst.settings
    for name in ("admission_timeout", "transfer_timeout", "control_timeout"):
        object.__setattr__(settings, name, 0.01)  # frozen: a write wait of 0.04 s
    d.abort("old")
    await asyncio.sleep(4 * settings.write_wait_timeout)
    d.abort("mid")
    d.abort("new")
    assert set(d.aborted) == {"mid", "new"}
    for i in range(5 * BLOCKS):
        d.abort(f"r{i}")
    assert len(d.aborted) == 4 * BLOCKS and "r0" in d.aborted and f"r{5 * BLOCKS - 1}" not in d.aborted


@pytest.mark.parametrize("mode", ["read", "write"])
async def test_a_prefill_instance_nobody_answers_for_is_a_retryable_502_blaming_prefill(
    mock_stand: Stand, mode: Mode
) -> None:
    s = mock_stand
    gone = EngineRef("prefill-9", "127.0.0.1:9", 1)  # nothing listens on the discard port
    req = GenerateRequest("r", PROMPT, 1, mode, gone, first_token=7, block_ids=[0, 1], layout=s.layout)
    with pytest.raises(ServingError) as info:
        await s.decode.generate(req)
    assert (info.value.status, info.value.retryable, info.value.cause) == (502, True, "prefill")
    assert s.decode.inst.pool.stats()["free"] == BLOCKS


async def test_a_prefill_that_lives_but_never_answers_fails_the_request_after_two_write_waits(
    mock_stand: Stand, caplog: pytest.LogCaptureFixture
) -> None:
    """Prefill (a bare engine here) takes remote_blocks and says nothing: decode waits a write wait, finds it
    alive, waits one more, then gives up with write_failed of its own, logs it, and frees its blocks."""
    s = mock_stand
    for name, value in (("admission_timeout", 0.02), ("transfer_timeout", 0.02), ("control_timeout", 0.5)):
        object.__setattr__(s.decode.inst.settings, name, value)  # frozen: a write wait of 1.04 s
    caplog.set_level(logging.ERROR, logger="moriio_async.serving")
    with pytest.raises(ServingError) as info:
        await asyncio.wait_for(s.decode.generate(GenerateRequest("w", PROMPT, 2, "write", s.ref)), 10)
    assert (info.value.status, info.value.cause) == (502, "prefill")
    assert str(info.value) == "prefill-0 could not write the KV: prefill-0 never answered"
    assert [r.getMessage() for r in caplog.records] == ["decode-0: prefill-0 never answered for w"]
    offer = control_decoder().decode((await s.prefill.recv_notification(timeout=10)).data)
    assert isinstance(offer, RemoteBlocks) and offer.request_id == "w" and len(offer.block_ids) == 2
    assert s.decode.inst.pool.stats()["free"] == BLOCKS and not s.decode.waiters


async def test_a_generation_whose_step_fails_ends_with_finish_reason_error_logs_it_and_frees_its_blocks(
    mock_stand: Stand, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    s = mock_stand

    def broken_step(*_args: object) -> int:
        raise RuntimeError("the model thread broke")

    monkeypatch.setattr(s.decode.inst.model, "decode_step", broken_step)
    caplog.set_level(logging.ERROR, logger="moriio_async.serving")
    req = GenerateRequest("r1", PROMPT, 3, "read", s.ref, first_token=7, block_ids=[0, 5], layout=s.layout)
    gen, _ = await s.decode.generate(req)
    assert gen.task.get_name() == "generate r1"  # how the instance's task list and asyncio's debug name it
    assert await tokens_of(gen) == ([7], "error")  # the first token (prefill's), then the failure
    await asyncio.wait_for(gen.task, 10)
    assert [r.getMessage() for r in caplog.records] == ["decode-0: generation of r1 failed"]
    assert caplog.records[0].exc_info is not None and "the model thread broke" in caplog.text
    assert s.decode.inst.pool.stats()["free"] == BLOCKS


async def test_an_answer_for_a_request_nobody_waits_for_is_dropped_quietly(
    write_pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    """A late write_done/write_failed (the request already ended on decode) changes nothing and fails no task."""
    p, d = write_pair.prefill, write_pair.decode
    caplog.set_level(logging.WARNING)

    async def serve(rid: str) -> None:
        gen_req = GenerateRequest(rid, PROMPT, 2, "write", p.inst.engine_ref())
        (gen, _), _ = await asyncio.gather(d.generate(gen_req), p.prefill(PrefillRequest(rid, PROMPT, "write")))
        assert (await tokens_of(gen))[1] == "length"
        await asyncio.wait_for(gen.task, 10)

    await serve("w0")
    for late in (
        WriteDone("w0", 3, TransferStats()),
        WriteFailed("w0", "too late"),
        WriteDone("never", 3, TransferStats()),
    ):
        await p.inst.notify(d.inst.engine_ref(), late)
    # Answers from one peer are handled in order: once the next request is served, the late ones were handled.
    await serve("w1")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert not d.waiters and d.inst.pool.stats()["free"] == BLOCKS


async def test_remote_blocks_that_cannot_be_sent_to_a_prefill_that_died_fail_the_request_at_once(
    mock_stand: Stand, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Prefill dies as decode offers its blocks: decode logs why the offer failed, settles it like an abort
    (it may have arrived), finds prefill gone and fails the request instead of waiting out a write wait."""
    s = mock_stand

    async def dying_prefill(ref: EngineRef, msg: object) -> None:
        await s.prefill.close()
        raise OSError("connection reset by peer")

    monkeypatch.setattr(s.decode.inst, "notify", dying_prefill)
    caplog.set_level(logging.INFO, logger="moriio_async.serving")
    with pytest.raises(ServingError) as info:
        await asyncio.wait_for(s.decode.generate(GenerateRequest("w", PROMPT, 2, "write", s.ref)), 10)
    assert (info.value.status, info.value.cause) == (502, "prefill")
    assert str(info.value) == "prefill-0 could not write the KV: prefill-0 is gone"
    assert "decode-0: remote_blocks for w not sent: connection reset by peer" in [
        r.getMessage() for r in caplog.records
    ]
    assert s.decode.inst.pool.stats()["free"] == BLOCKS and not s.decode.waiters


# -- the decode app: /generate over HTTP -----------------------------------------------------------


def decode_app_settings() -> InstanceSettings:
    return InstanceSettings("decode-0", "decode", SMALL, BLOCKS, backend="mock")


async def test_the_decode_app_streams_the_tokens_as_ndjson_with_the_kv_figures_as_headers(mock_stand: Stand) -> None:
    s = mock_stand
    app = create_decode_app(decode_app_settings())
    assert app.title == "moriio_async decode decode-0"  # what /docs and /openapi.json call it
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://decode-0") as client:
            req = GenerateRequest("r1", PROMPT, 3, "read", s.ref, first_token=7, block_ids=[0, 5], layout=s.layout)
            resp = await client.post("/generate", content=msgspec.json.encode(req))
            assert resp.status_code == 200, resp.text
            assert resp.headers["content-type"] == "application/x-ndjson"
            lines = [msgspec.json.decode(line, type=TokenLine) for line in resp.content.splitlines()]
            assert len(lines) == 4 and lines[0].token == 7 and lines[-1].finish_reason == "length"  # 3 tokens, the end
            assert all(line.token is not None for line in lines[:-1])
            assert int(resp.headers["x-kv-bytes"]) == SMALL.n_layers * 2 * 2 * SMALL.block_bytes
            assert float(resp.headers["x-kv-exposed-s"]) == float(resp.headers["x-kv-transfer-s"]) > 0


async def test_a_client_gone_before_its_stream_started_stops_the_generation(
    mock_stand: Stand, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The proxy hangs up as decode answers, before the first token was streamed: the response's background
    closes the generation, which stops after the step it was in instead of running out its max_tokens."""
    s = mock_stand
    steps: list[int] = []
    gate = threading.Event()
    decode_step = Model.decode_step

    def held_step(model: Model, token: int, pos: int, cache: np.ndarray, block_table: list[int]) -> int:
        steps.append(pos)
        gate.wait(10)  # the generation stays inside its first step until the client has gone
        return decode_step(model, token, pos, cache, block_table)

    monkeypatch.setattr(Model, "decode_step", held_step)
    req = GenerateRequest("r1", PROMPT, 20, "read", s.ref, first_token=7, block_ids=[0, 5], layout=s.layout)
    received: list[Message] = [{"type": "http.request", "body": msgspec.json.encode(req), "more_body": False}]

    async def receive() -> Message:
        return received.pop(0) if received else {"type": "http.disconnect"}

    sent: list[Message] = []
    never = asyncio.Event()

    async def send(message: Message) -> None:
        sent.append(message)
        if message["type"] == "http.response.start":
            await never.wait()  # the response's head never gets through: the client hung up

    scope: Scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/generate", "raw_path": b"/generate", "root_path": "", "query_string": b"",
        "headers": [(b"host", b"decode-0"), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1), "server": ("decode-0", 80),
    }  # fmt: skip
    app = create_decode_app(decode_app_settings())
    try:
        async with app.router.lifespan_context(app):
            await asyncio.wait_for(app(scope, receive, send), 10)
            gate.set()
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://decode-0") as client:
                while (await client.get("/health")).json()["blocks"]["free"] != BLOCKS:  # noqa: ASYNC110 (polls the app: no event says the blocks came back)
                    await asyncio.sleep(0.005)
    finally:
        gate.set()
    assert not [m for m in sent if m["type"] == "http.response.body" and m.get("body")]  # no token reached it
    assert steps == [len(PROMPT)], "the generation went on past the step it was in"
