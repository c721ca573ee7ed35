"""Bad input raises a clear error and posts nothing."""

from __future__ import annotations

import asyncio
import mmap

import numpy as np
import pytest

from moriio_async import (
    Access,
    EngineClosed,
    InvalidArgument,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    MemoryInUse,
    SessionClosed,
    TcpOptions,
)

from .conftest import Pair


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda s: s.read(0, 0, 0), "size 0 must be positive"),
        (lambda s: s.write(0, 0, -5), "must be positive"),
        (lambda s: s.read((1 << 20) - 10, 0, 11), "exceeds the local region"),
        (lambda s: s.write(0, (1 << 20) - 1, 2), "exceeds the remote region"),
        (lambda s: s.batch_read([0, 1], [0], [1, 1]), "list lengths differ"),
        (lambda s: s.batch_write([0, 8, -8], [0, 8, 16], [8, 8, 8]), "block 2: offsets must be >= 0"),
        (lambda s: s.batch_read([], [], []), "empty batch"),
        (lambda s: s.read("0", 0, 1), "is str, not an integer"),
    ],
)
async def test_bad_blocks_raise_and_post_nothing(pair: Pair, call: object, needle: str) -> None:
    before = pair.session.statistics()
    with pytest.raises(InvalidArgument) as info:
        call(pair.session)  # type: ignore[operator]
    assert needle in str(info.value)
    assert pair.session.statistics() == before
    assert pair.a.outstanding == 0


async def test_a_bad_block_anywhere_in_a_batch_posts_none_of_it(pair: Pair) -> None:
    offs = list(range(0, 100 * 64, 64))
    with pytest.raises(InvalidArgument, match="block 99"):
        pair.session.batch_write(offs, [*offs[:-1], 1 << 20], [64] * 100)
    assert pair.session.statistics().posted == 0


@pytest.mark.parametrize(
    ("buffer", "needle"),
    [
        (b"immutable", "read-only"),
        (np.zeros((8, 8), dtype=np.uint8)[:, ::2], "not C-contiguous"),
        (bytearray(), "empty"),
        (object(), "does not support the buffer protocol"),
    ],
)
async def test_unusable_buffers_are_refused(pair: Pair, buffer: object, needle: str) -> None:
    with pytest.raises(InvalidArgument, match=needle):
        pair.a.register_memory(buffer)


async def test_accepted_buffer_kinds(pair: Pair) -> None:
    m = mmap.mmap(-1, 4096)
    try:
        for buf in [bytearray(64), np.zeros((4, 4), dtype=np.float32), memoryview(bytearray(16)), m]:
            desc = pair.a.register_memory(buf)
            assert desc.length == memoryview(buf).nbytes  # type: ignore[arg-type]
            pair.a.deregister_memory(desc)
    finally:
        m.close()


async def test_duplicate_export_name_is_refused(pair: Pair) -> None:
    with pytest.raises(InvalidArgument, match="already registered"):
        pair.a.register_memory(bytearray(8), name="kv")


async def test_access_rights_are_checked_locally(pair: Pair) -> None:
    ro = pair.b.register_memory(bytearray(64), name="ro", access=Access.REMOTE_READ)
    peer = await pair.a.connect(pair.b.address)
    s = await pair.a.create_session(pair.desc_a, peer.memory["ro"])
    with pytest.raises(InvalidArgument, match="REMOTE_WRITE"):
        s.write(0, 0, 8)
    await s.read(0, 0, 8)
    assert ro.access == Access.REMOTE_READ


async def test_closed_session_and_engine_refuse_work(pair: Pair) -> None:
    await pair.session.close()
    with pytest.raises(SessionClosed):
        pair.session.read(0, 0, 1)
    await pair.a.close()
    with pytest.raises(EngineClosed):
        pair.a.register_memory(bytearray(8))
    with pytest.raises(EngineClosed):
        await pair.a.connect(pair.b.address)


async def test_unknown_descriptors_are_refused(pair: Pair) -> None:
    foreign = MemoryDesc("a", pair.a.incarnation, "x", 0x1000, 64, 12345, Access.all())
    with pytest.raises(InvalidArgument, match="not a live registration"):
        pair.a.deregister_memory(foreign)
    with pytest.raises(InvalidArgument, match="not a live registration"):
        await pair.a.create_session(foreign, pair.session.remote)
    ghost = MemoryDesc("nobody", 1, "kv", 0x1000, 64, 1, Access.all())
    with pytest.raises(InvalidArgument, match="unknown peer engine"):
        await pair.a.create_session(pair.desc_a, ghost)


async def test_deregistering_memory_in_use_is_refused_until_transfers_end(held: Pair) -> None:
    t = held.session.read(0, 0, 64)
    with pytest.raises(MemoryInUse):
        held.a.deregister_memory(held.desc_a)
    release = held.a.loop.create_task(held.a.release_memory(held.desc_a, timeout=5))
    held.session.channel.qp.step(1)  # type: ignore[attr-defined]
    await t
    await release
    with pytest.raises(InvalidArgument):
        held.session.read(0, 0, 1)


async def test_release_memory_waits_for_every_transfer_that_uses_the_region(held: Pair) -> None:
    first, second = held.session.read(0, 0, 64), held.session.read(64, 64, 64)
    release = held.a.loop.create_task(held.a.release_memory(held.desc_a, timeout=5))
    held.session.channel.qp.step(1)  # type: ignore[attr-defined]
    await first
    for _ in range(20):  # every callback the first transfer's end queued has run
        await asyncio.sleep(0)
    assert not release.done(), "one transfer still reads into the region"
    held.session.channel.qp.step(1)  # type: ignore[attr-defined]
    await second
    await release
    with pytest.raises(InvalidArgument):
        held.session.read(0, 0, 1)


async def test_bad_addresses_and_configs() -> None:
    with pytest.raises(InvalidArgument):
        IOEngineConfig(transfer_timeout=0)
    with pytest.raises(InvalidArgument):
        IOEngineConfig(port=70000)
    with pytest.raises(InvalidArgument, match=r"TcpOptions\.max_data_hellos"):
        TcpOptions(max_data_hellos=0)
    # The TCP backend's cap on connections in their hello comes from the engine's config.
    assert IOEngineConfig(tcp=TcpOptions(max_data_hellos=3)).backend_options("tcp").specific == TcpOptions(3)
    for name in ("hello_timeout", "failure_lockout"):
        with pytest.raises(InvalidArgument, match=name):
            IOEngineConfig(**{name: 0})  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=r"TcpOptions\.max_data_hellos_per_address"):
        TcpOptions(max_data_hellos_per_address=0)
    for name in ("max_hellos", "max_hellos_per_address", "max_failures_per_source"):
        with pytest.raises(InvalidArgument, match=name):
            IOEngineConfig(**{name: 0})  # type: ignore[arg-type]
    options = IOEngineConfig(hello_timeout=2.0, max_failures_per_source=7, failure_lockout=9.0).backend_options("tcp")
    assert options.hello_timeout == 2.0
    assert (options.max_failures_per_source, options.failure_lockout) == (7, 9.0)
    async with IOEngine("x", IOEngineConfig(backend="mock")) as e:
        with pytest.raises(InvalidArgument, match="host:port"):
            await e.connect("nonsense")


async def test_calls_that_change_the_engine_are_refused_off_its_loop_thread(pair: Pair) -> None:
    """The engine's tables belong to its loop: from another thread, each state-changing call raises and
    changes nothing (moriio_async.compat.mori hands such calls to the loop). The thread-safe ones work."""
    a, b = pair.a, pair.b
    desc_b = b.get_engine_desc()
    calls = {
        "register_memory": lambda: a.register_memory(bytearray(64), name="other"),
        "allocate_memory": lambda: a.allocate_memory(4096),
        "export_memory": lambda: a.export_memory(pair.desc_a),
        "deregister_memory": lambda: a.deregister_memory(pair.desc_a),
        "register_remote_engine": lambda: a.register_remote_engine(desc_b),
        "deregister_remote_engine": lambda: a.deregister_remote_engine("b"),
        "announce_transfer": lambda: a.announce_transfer("b", 1),
        "drain_completions": a.drain_completions,
    }
    regions = a.statistics().regions
    for name, call in calls.items():
        with pytest.raises(InvalidArgument, match=f"IOEngine.{name} was called off the thread"):
            await asyncio.to_thread(call)
    assert a.statistics().regions == regions
    assert await asyncio.to_thread(a.allocate_transfer_uid) >= 0  # documented as safe from any thread
    assert await asyncio.to_thread(b.pop_inbound_transfer_status, "a", 1) is None  # nothing was announced
    await pair.session.write(0, 0, 64)  # "b" is still known, the region still registered
    a.announce_transfer("b", 1)  # on the loop: fine
    assert await b.wait_inbound_transfer_status("a", 1, timeout=5) is not None
