"""compat.mori's engine: MoRI-IO's calls, descriptors, memory, backends and edge cases."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import re
import socket
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from moriio_async import InvalidArgument
from moriio_async import IOEngineConfig as AsyncConfig
from moriio_async.compat.mori import (
    BackendType,
    EngineDesc,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    MemoryLocationType,
    RdmaBackendConfig,
    StatusCode,
    TransferStatus,
    XgmiBackendConfig,
)
from moriio_async.compat.mori import desc as desc_module
from moriio_async.compat.mori.desc import node_id
from moriio_async.compat.mori.plan import check_blocks
from moriio_async.compat.mori.runtime import NO_BACKEND

from .conftest import make_pair, on_loop, options, register
from .test_inbound import wait_inbound


def test_read_write_engine_level_and_session_level(pair: tuple[IOEngine, IOEngine]) -> None:
    a, b = pair
    x, mx = register(a, 64 << 10)
    y, my = register(b, 64 << 10)
    my = MemoryDesc.unpack(my.pack())  # as a peer would receive it
    st = a.write(mx, 0, my, 0, 32 << 10, a.allocate_transfer_uid())
    assert st.WaitFor(10_000) is StatusCode.SUCCESS, st.Message()
    assert st.Message() == "success"  # MoRI-IO's ibv_wc_status_str(IBV_WC_SUCCESS)
    assert np.array_equal(x[: 32 << 10], y[: 32 << 10])
    st = a.read(mx, 32 << 10, my, 0, 32 << 10, a.allocate_transfer_uid())
    st.Wait()
    assert st.Succeeded() and np.array_equal(x[32 << 10 :], y[: 32 << 10])
    session = a.create_session(mx, my)
    assert session is not None and session.alive()
    y[:] = 0
    offsets = [i << 12 for i in range(16)]
    st = session.batch_write(offsets, offsets[::-1], [4096] * 16, session.allocate_transfer_uid())
    st.Wait()
    assert st.Succeeded()
    for i in range(16):
        assert np.array_equal(x[i << 12 : (i + 1) << 12], y[(15 - i) << 12 : (16 - i) << 12])
    y[: 8 << 10] = 9  # a session's batch_read moves the other way: the remote bytes into the local region
    st = session.batch_read([0, 4096], [0, 4096], [4096, 4096], session.allocate_transfer_uid())
    assert st.WaitFor(10_000) is StatusCode.SUCCESS
    assert (x[: 8 << 10] == 9).all() and (y[: 8 << 10] == 9).all()
    session.close()
    assert not session.alive()
    after = session.read(0, 0, 8)
    assert after.Code() is StatusCode.ERR_BAD_STATE and after.Message() == "session is closed"
    session.close()  # closing a closed session does nothing, so it waits for nothing: fine on the loop thread too
    on_loop(a, session.close)


def test_engine_level_batch_over_several_regions(pair: tuple[IOEngine, IOEngine]) -> None:
    a, b = pair
    regions = [(register(a, 4096), register(b, 4096)) for _ in range(3)]
    offsets = [[0, 1024, 3072] for _ in regions]
    sizes = [[1024, 1024, 1024] for _ in regions]
    uids = [a.allocate_transfer_uid() for _ in regions]
    statuses = a.batch_read(
        [local[1] for local, _ in regions], offsets, [remote[1] for _, remote in regions], offsets, sizes, uids
    )
    assert len(statuses) == 3
    assert a.wait_all(statuses, 10_000) is StatusCode.SUCCESS
    for (x, _), (y, _) in regions:
        assert np.array_equal(x[:2048], y[:2048]) and np.array_equal(x[3072:], y[3072:])
        assert not np.array_equal(x[2048:3072], y[2048:3072])
    with pytest.raises(ValueError, match="one descriptor"):
        a.batch_write([regions[0][0][1]], offsets, [regions[0][1][1]], offsets, sizes, uids)


def test_engine_level_batches_move_bytes_their_own_way_and_file_their_uids_at_the_target(
    pair: tuple[IOEngine, IOEngine],
) -> None:
    """``batch_read`` fills the local regions from the remote ones and leaves those as they were;
    ``batch_write`` the other way round. Each batch's uid is the one the target files its outcome under."""
    a, b = pair
    regions = [(register(a, 4096), register(b, 4096)) for _ in range(2)]
    locals_ = [local[1] for local, _ in regions]
    remotes = [remote[1] for _, remote in regions]
    offsets, sizes = [[0, 2048] for _ in regions], [[1024, 1024] for _ in regions]
    rng = np.random.default_rng()
    for read in (True, False):
        for (x, _), (y, _) in regions:  # fresh bytes each pass: the read pass made both sides equal where it moved
            x[:] = rng.integers(0, 256, x.size, dtype=np.uint8)
            y[:] = x ^ 0xFF  # differs from x at every byte, so a move the wrong way always shows
        before = [(x.copy(), y.copy()) for (x, _), (y, _) in regions]
        uids = [9000 + 10 * read + i for i in range(len(regions))]
        call = a.batch_read if read else a.batch_write
        assert a.wait_all(call(locals_, offsets, remotes, offsets, sizes, uids), 10_000) is StatusCode.SUCCESS
        for ((x, _), (y, _)), (x0, y0) in zip(regions, before, strict=True):
            dst, src, src0, dst0 = (x, y, y0, x0) if read else (y, x, x0, y0)
            assert np.array_equal(src, src0), "the side read from is left as it was"
            for start in (0, 2048):
                assert np.array_equal(dst[start : start + 1024], src0[start : start + 1024])
            assert np.array_equal(dst[1024:2048], dst0[1024:2048]) and np.array_equal(dst[3072:], dst0[3072:])
        single = 9100 + read  # the single-block calls move their way too, and carry their uid
        (x, _), (y, _) = regions[0]
        x0, y0 = x.copy(), y.copy()
        call1 = a.read if read else a.write
        lo, ro = (1024, 1536) if read else (1152, 1664)  # bytes no call before touched (random on both sides)
        assert call1(locals_[0], lo, remotes[0], ro, 64, single).WaitFor(10_000) is StatusCode.SUCCESS
        if read:
            assert np.array_equal(x[lo : lo + 64], y0[ro : ro + 64]) and np.array_equal(y, y0)
        else:
            assert np.array_equal(y[ro : ro + 64], x0[lo : lo + 64]) and np.array_equal(x, x0)
        for uid in [*uids, single]:
            deadline = time.monotonic() + 5
            while (inbound := b.pop_inbound_transfer_status(a.key, uid)) is None:
                assert time.monotonic() < deadline, f"the target never filed uid {uid}"
                time.sleep(0.001)
            assert inbound.Succeeded()
    said = "batch_read/batch_write: one descriptor, offset list, size list and uid per batch"
    with pytest.raises(ValueError, match=f"^{re.escape(said)}$"):
        a.batch_read(locals_, offsets, remotes, offsets, sizes, [1])


def test_empty_batches_and_zero_size_blocks_as_mori(pair: tuple[IOEngine, IOEngine]) -> None:
    a, b = pair
    x, mx = register(a, 4096)
    y, my = register(b, 4096, fill=0)
    session = a.create_session(mx, my)
    assert session is not None
    empty = session.batch_write([], [], [])
    assert empty.Code() is StatusCode.SUCCESS and empty.Message() == ""
    assert a.batch_write([mx], [[]], [my], [[]], [[]], [7])[0].Code() is StatusCode.SUCCESS
    # size-0 blocks are checked (offset <= size) and move nothing; the rest of the batch goes
    st = session.batch_write([4096, 0, 100], [4096, 0, 100], [0, 16, 0])
    st.Wait()
    assert st.Succeeded() and np.array_equal(x[:16], y[:16]) and not y[16:].any()
    assert session.write(10, 10, 0).Code() is StatusCode.SUCCESS
    # engine-level, every block of size 0: posted, moves nothing, succeeds with no message and is announced
    uid = a.allocate_transfer_uid()
    zero = a.write(mx, 10, my, 10, 0, uid)
    assert zero.WaitFor(10_000) is StatusCode.SUCCESS and zero.Message() == ""
    inbound = wait_inbound(b, a.key, uid)
    assert inbound is not None and inbound.Code() is StatusCode.SUCCESS
    bad = session.batch_write([4097], [0], [0])
    assert bad.Code() is StatusCode.ERR_INVALID_ARGS and bad.Message() == "length out of range"


def test_bad_input_fails_the_status_at_once(pair: tuple[IOEngine, IOEngine]) -> None:
    a, b = pair
    _, mx = register(a, 64)
    _, my = register(b, 64)
    session = a.create_session(mx, my)
    assert session is not None
    st = session.batch_read((0, 32), (0, 32), (32, 34), session.allocate_transfer_uid())  # MoRI's test
    assert st.Failed() and st.Code() == StatusCode.ERR_INVALID_ARGS
    st = session.batch_read([0, 1], [0], [1])
    assert st.Message() == "lengths of local offsets, remote offsets or sizes mismatch"
    assert session.read(-1, 0, 1).Code() is StatusCode.ERR_INVALID_ARGS
    assert session.read(0, 0, 1.5).Code() is StatusCode.ERR_INVALID_ARGS  # type: ignore[arg-type]
    for flag in ([True], [0], [1]), ([0], [False], [1]), ([0], [0], [True]):  # a bool is no offset or size
        assert session.batch_read(*flag).Code() is StatusCode.ERR_INVALID_ARGS, flag  # type: ignore[arg-type]
    huge = session.batch_read([0], [0], [1 << 32])
    assert "exceeds UINT32_MAX" in huge.Message()
    assert a.read(mx, 0, my, 60, 8, 1).Code() is StatusCode.ERR_INVALID_ARGS


def test_block_checks_say_which_value_is_bad_and_bound_each_side_and_size() -> None:
    assert check_blocks([-1], [0], [1], 64, 64) == "invalid block: -1 is negative"
    assert check_blocks([0], [True], [1], 64, 64) == "invalid block: True is not an integer"
    assert check_blocks([60], [0], [8], 64, 64) == "length out of range"  # the local side alone overflows
    assert check_blocks([0], [60], [8], 64, 64) == "length out of range"  # the remote side alone
    assert check_blocks([0], [0], [0], 0, 0) == ([0], [0], [0])  # offset 0 is no negative offset
    # UINT32_MAX itself is a size MoRI-IO takes; one byte more is refused for its size before its range
    uint32_max = (1 << 32) - 1
    assert check_blocks([0], [0], [uint32_max], uint32_max, uint32_max) == ([0], [0], [uint32_max])
    too_big = check_blocks([0], [0], [1 << 32], 1 << 40, 1 << 40)
    assert too_big == "single request size 4294967296 exceeds UINT32_MAX; split it before submitting"


def test_no_backend_no_session_and_bad_state() -> None:
    config = IOEngineConfig(host="127.0.0.1", port=0, options=options("mock"))
    a, b = IOEngine("nb-initiator", config), IOEngine("nb-target", config)
    try:
        a.register_remote_engine(b.get_engine_desc())
        _, mx = register(a, 32)
        _, my = register(b, 32)
        st = a.batch_read([mx], [(0, 16)], [my], [(0, 16)], [(16, 16)], [a.allocate_transfer_uid()])[0]
        assert st.Failed() and st.Code() == StatusCode.ERR_BAD_STATE
        assert a.create_session(mx, my) is None
        a.create_backend(BackendType.TCP)
        assert a.create_session(mx, my) is not None
        a.remove_backend(BackendType.TCP)
        assert a.read(mx, 0, my, 0, 8).Code() is StatusCode.ERR_BAD_STATE
    finally:
        a.close()
        b.close()


def test_deregister_remote_engine(pair: tuple[IOEngine, IOEngine]) -> None:
    a, b = pair
    x, mx = register(a, 256)
    y, my = register(b, 256)
    session = a.create_session(mx, my)
    assert session is not None
    assert a.write(mx, 0, my, 0, 256).WaitFor(10_000) is StatusCode.SUCCESS
    a.deregister_remote_engine(b.get_engine_desc())
    assert a.create_session(mx, my) is None
    assert a.write(mx, 0, my, 0, 8).Code() is StatusCode.ERR_BAD_STATE
    st = session.write(0, 0, 256)  # an existing session keeps working, as in MoRI-IO
    assert st.WaitFor(10_000) is StatusCode.SUCCESS and np.array_equal(x, y)
    # the engine-level transfer's own session closed with the deregistration: only the explicit one's pairs remain
    stripes = len(session.stripes)
    deadline = time.monotonic() + 5
    while on_loop(a, lambda: a.aio.statistics().peers.opened_qps) != stripes:
        assert time.monotonic() < deadline, "the engine-level session was not closed"
        time.sleep(0.005)
    with pytest.raises(InvalidArgument):  # the engine underneath forgot b for new work too
        a.notify(b.key, b"after")
    a.deregister_remote_engine(b.get_engine_desc())  # again: nothing left to forget, and no error
    assert session.write(0, 0, 8).WaitFor(10_000) is StatusCode.SUCCESS


def test_deregistering_memory_closes_the_engine_level_session_on_it_and_others_go_on(
    pair: tuple[IOEngine, IOEngine],
) -> None:
    a, b = pair
    register(b, 64)  # b's first region: the id of b's region below differs from a's deregistered one
    y, my = register(b, 256, fill=0)
    x, mx = register(a, 256)
    z, mz = register(a, 256)

    def opened() -> int:
        return on_loop(a, lambda: a.aio.statistics().peers.opened_qps)

    assert a.write(mz, 0, my, 0, 256).WaitFor(10_000) is StatusCode.SUCCESS
    kept = opened()
    assert a.write(mx, 0, my, 0, 256).WaitFor(10_000) is StatusCode.SUCCESS
    assert opened() > kept and np.array_equal(x, y)
    a.deregister_memory(mx)
    deadline = time.monotonic() + 5
    while opened() != kept:  # mx's cached session closed; mz's stays open
        assert time.monotonic() < deadline, "the engine-level session on the deregistered memory was not closed"
        time.sleep(0.005)
    assert a.write(mz, 0, my, 0, 256).WaitFor(10_000) is StatusCode.SUCCESS
    assert opened() == kept and np.array_equal(z, y)


def test_a_call_made_as_its_pairs_session_opens_runs_after_the_calls_that_waited_for_it(
    pair: tuple[IOEngine, IOEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engine-level calls for one pair keep their order, also the one that reaches the loop after the
    session opened but before the calls waiting for it were posted: two writes to the same bytes land
    in the order they were made (the later one's bytes stay)."""
    a, b = pair
    x, mx = register(a, 16)
    x[:8], x[8:] = 1, 2
    y, my = register(b, 8, fill=0)
    real = a.aio.create_session
    later: list[TransferStatus] = []

    async def open_then_call(*args: Any, **kwargs: Any) -> Any:
        session = await real(*args, **kwargs)
        later.append(a.write(mx, 8, my, 0, 8))  # reaches the loop before the open's waiting calls run
        return session

    monkeypatch.setattr(a.aio, "create_session", open_then_call)
    assert a.write(mx, 0, my, 0, 8).WaitFor(10_000) is StatusCode.SUCCESS
    assert len(later) == 1 and later[0].WaitFor(10_000) is StatusCode.SUCCESS
    assert (y == 2).all()


def test_a_remote_engine_registered_again_while_a_call_to_it_opened_its_session_stays_known(
    pair: tuple[IOEngine, IOEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deregistering a peer while an accepted call still opens its session forgets it only once that open
    ended, and not at all if it was registered again meanwhile: later calls and notifications reach it."""
    a, b = pair
    x, mx = register(a, 64)
    y, my = register(b, 64, fill=0)
    real = a.aio.create_session
    go = threading.Event()

    async def held_open(*args: Any, **kwargs: Any) -> Any:
        await asyncio.get_running_loop().run_in_executor(None, go.wait, 10)  # until re-registered
        return await real(*args, **kwargs)

    monkeypatch.setattr(a.aio, "create_session", held_open)
    accepted = a.write(mx, 0, my, 0, 64)
    a.deregister_remote_engine(b.get_engine_desc())
    a.register_remote_engine(b.get_engine_desc())
    go.set()
    assert accepted.WaitFor(10_000) is StatusCode.SUCCESS and np.array_equal(x, y)
    a.notify(b.key, b"still known")
    assert b.recv_notification(timeout=10) == (a.key, b"still known")
    session = a.create_session(mx, my)
    assert session is not None and session.write(0, 0, 64).WaitFor(10_000) is StatusCode.SUCCESS


def test_descriptors_pack_unpack_and_refuse_garbage(pair: tuple[IOEngine, IOEngine]) -> None:
    a, _ = pair
    desc = a.get_engine_desc()
    assert desc.key == a.key and desc.port > 0 and desc.pid == os.getpid()
    assert desc.node_id == node_id() and desc.hostname == socket.gethostname()
    assert on_loop(a, a.aio.get_engine_desc).transports and desc.inner.transports == ()  # the peer's hello tells them
    assert EngineDesc.unpack(desc.pack()) == desc
    buf, mem = register(a, 128)
    assert mem.engine_key == a.key and mem.size == 128 and mem.data == buf.ctypes.data
    assert mem.loc == MemoryLocationType.CPU and mem.device_id == -1 and mem.device_bus_id == ""
    assert mem.numa_node >= -1 and mem.ipc_handle == bytes(64)
    assert MemoryDesc.unpack(mem.pack()) == mem
    for raw in (b"", b"[]", b'{"kind":"mori.MemoryDesc"}', desc.pack()):
        with pytest.raises(InvalidArgument):
            MemoryDesc.unpack(raw)
    with pytest.raises(InvalidArgument):
        EngineDesc.unpack(mem.pack())


def test_node_id_is_mori_node_id_else_the_boot_id_else_the_host_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MORI_NODE_ID", "node-7")
    assert node_id() == "node-7"
    monkeypatch.delenv("MORI_NODE_ID")
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert node_id() == f.read().strip() != ""

    def no_proc(*_: object, **__: object) -> None:
        raise FileNotFoundError("no /proc here")

    monkeypatch.setattr(desc_module, "open", no_proc, raising=False)
    assert node_id() == socket.gethostname()


def test_register_memory_takes_a_raw_address(pair: tuple[IOEngine, IOEngine]) -> None:
    a, b = pair
    raw = ctypes.create_string_buffer(b"moriio" * 100, 600)
    mem = a.register_memory(ctypes.addressof(raw), 600, -1, MemoryLocationType.CPU)
    y, my = register(b, 600, fill=0)
    assert a.write(mem, 0, my, 0, 600).WaitFor(10_000) is StatusCode.SUCCESS
    assert y.tobytes() == raw.raw
    with pytest.raises(RuntimeError, match="GPU backend"):
        a.register_memory(ctypes.addressof(raw), 600, 0, MemoryLocationType.GPU)
    with pytest.raises(ValueError, match="size > 0"):
        a.register_memory(ctypes.addressof(raw), 0, -1, MemoryLocationType.CPU)
    a.deregister_memory(mem)
    assert a.write(mem, 0, my, 0, 8).WaitFor(10_000) is not StatusCode.SUCCESS


@dataclass
class FakeDevice:
    type: str
    index: int | None = None


class TensorDouble:
    """torch.Tensor's registration surface over a numpy array (torch is not installed here)."""

    def __init__(self, array: np.ndarray, device: FakeDevice, contiguous: bool = True) -> None:
        self.array, self.device, self.contiguous = array, device, contiguous

    def is_contiguous(self) -> bool:
        return self.contiguous

    def nelement(self) -> int:
        return int(self.array.size)

    def element_size(self) -> int:
        return int(self.array.itemsize)

    def data_ptr(self) -> int:
        return int(self.array.ctypes.data)


def test_register_torch_tensor_cpu_and_a_clear_error_for_device_memory(pair: tuple[IOEngine, IOEngine]) -> None:
    a, b = pair
    array = np.arange(256, dtype=np.float32)
    mem = a.register_torch_tensor(TensorDouble(array, FakeDevice("cpu")))
    assert mem.size == 1024 and mem.data == array.ctypes.data
    y, my = register(b, 1024, fill=0)
    assert a.write(mem, 0, my, 0, 1024).WaitFor(10_000) is StatusCode.SUCCESS
    assert np.array_equal(y.view(np.float32), array)
    with pytest.raises(RuntimeError, match=r"cuda:0.*GPU backend"):
        a.register_torch_tensor(TensorDouble(array, FakeDevice("cuda", 0)))
    with pytest.raises(RuntimeError, match=r"^register_torch_tensor: the tensor is on cuda: device memory"):
        a.register_torch_tensor(TensorDouble(array, FakeDevice("cuda")))  # no index: none named
    with pytest.raises(RuntimeError, match=r"^input tensor must be contiguous$"):  # MoRI-IO's words
        a.register_torch_tensor(TensorDouble(array, FakeDevice("cpu"), contiguous=False))
    with pytest.raises(ValueError, match=r"^register_torch_tensor: the tensor is empty$"):
        a.register_torch_tensor(TensorDouble(np.zeros(0, dtype=np.float32), FakeDevice("cpu")))
    one = np.full(1, 7, dtype=np.uint8)  # the smallest tensor there is: one byte
    mem1 = a.register_torch_tensor(TensorDouble(one, FakeDevice("cpu")))
    assert (mem1.size, mem1.data, mem1.device_id) == (1, one.ctypes.data, -1)  # no device index: -1
    assert a.register_torch_tensor(TensorDouble(one, FakeDevice("cpu", 3))).device_id == 3
    held = TensorDouble(np.ones(64, dtype=np.uint8), FakeDevice("cpu"))
    kept = weakref.ref(held)
    a.register_torch_tensor(held)
    del held
    gc.collect()
    assert kept() is not None, "the registration must keep the tensor (and so its memory) alive"
    assert a.write(mem1, 0, my, 5, 1).WaitFor(10_000) is StatusCode.SUCCESS and y[5] == 7


def test_register_torch_tensor_with_real_torch(pair: tuple[IOEngine, IOEngine]) -> None:
    torch: Any = pytest.importorskip("torch")
    a, _ = pair
    tensor = torch.ones([1, 2, 34, 56])
    mem = a.register_torch_tensor(tensor)
    assert mem.data == tensor.data_ptr() and mem.size == tensor.nelement() * tensor.element_size()


def test_backend_types_and_config_defaults() -> None:
    cfg = RdmaBackendConfig()
    assert (cfg.qp_per_transfer, cfg.post_batch_size, cfg.num_worker_threads) == (1, -1, -1)
    assert cfg.enable_notification and cfg.notif_per_qp == 1024 and cfg.chunk_bytes == 65536
    assert (cfg.max_chunks_per_transfer, cfg.num_nics_per_transfer, cfg.max_send_wr) == (64, 1, 0)
    with pytest.raises(RuntimeError, match="notifPerQp"):
        RdmaBackendConfig(notif_per_qp=0).effective()
    with pytest.raises(RuntimeError, match="qp_per_transfer"):
        RdmaBackendConfig(qp_per_transfer=0).effective()
    engine = IOEngine("types", IOEngineConfig(host="127.0.0.1", port=0))
    try:
        with pytest.raises(NotImplementedError, match="GPU"):
            engine.create_backend(BackendType.XGMI, XgmiBackendConfig())
        engine.create_backend(BackendType.TCP, RdmaBackendConfig(max_send_wr=64, max_msg_sge=4))
        assert engine.aio.backend_name == "tcp"
        assert (engine.aio.config.sq_depth, engine.aio.config.max_sge) == (64, 4)
        engine.create_backend(BackendType.TCP)  # a second time: logged and skipped, as in MoRI-IO
        assert (engine.aio.config.sq_depth, engine.aio.config.max_sge) == (64, 4)  # the first one's settings stay
    finally:
        engine.close()


def test_creating_a_backend_type_again_is_logged_and_skipped_with_its_config(
    pair: tuple[IOEngine, IOEngine], caplog: pytest.LogCaptureFixture
) -> None:
    a, b = pair
    with caplog.at_level(logging.WARNING, logger="moriio_async"):
        a.create_backend(BackendType.RDMA, RdmaBackendConfig(qp_per_transfer=2))
    assert "Backend type BackendType.RDMA already exists, skip duplicate creation" in caplog.messages
    _, mx = register(a, 64)
    _, my = register(b, 64)
    session = a.create_session(mx, my)
    assert session is not None and len(session.stripes) == 1  # the first creation's config stays


def test_mori_env_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MORI_IO_QP_PER_TRANSFER", "3")
    monkeypatch.setenv("MORI_IO_POST_BATCH_SIZE", "2")
    monkeypatch.setenv("MORI_IO_ENABLE_NOTIFICATION", "0")
    cfg = RdmaBackendConfig().effective()
    assert (cfg.qp_per_transfer, cfg.post_batch_size, cfg.enable_notification) == (3, 2, False)
    a, b = make_pair("env", "mock")
    try:
        _, mx = register(a, 64)
        _, my = register(b, 64)
        session = a.create_session(mx, my)
        assert session is not None and len(session.stripes) == 3
    finally:
        a.close()
        b.close()


def test_a_tcp_only_peer_reaches_a_multi_transport_engine_with_its_packed_descriptor() -> None:
    """The owner opens cma then tcp (its descriptor's ``rkey`` is cma's); a peer with tcp alone, given
    the packed descriptor, must name the tcp rkey (``rkeys``) or every request is refused."""
    owner = IOEngine("multi-owner", IOEngineConfig(host="127.0.0.1", port=0, options=options("auto")))
    peer = IOEngine("tcp-peer", IOEngineConfig(host="127.0.0.1", port=0, options=AsyncConfig(backends=("tcp",))))
    try:
        for engine in (owner, peer):
            engine.create_backend(BackendType.TCP)
        peer.register_remote_engine(EngineDesc.unpack(owner.get_engine_desc().pack()))
        x, mx = register(owner, 64 << 10)
        y, my = register(peer, 64 << 10, fill=0)
        assert dict(mx.rkeys).keys() == {"cma", "tcp"} and mx.rkey == dict(mx.rkeys)["cma"]
        st = peer.read(my, 0, MemoryDesc.unpack(mx.pack()), 0, 64 << 10, peer.allocate_transfer_uid())
        assert st.WaitFor(10_000) is StatusCode.SUCCESS, st.Message()
        assert np.array_equal(x, y)
    finally:
        owner.close()
        peer.close()


def test_engine_level_calls_that_cannot_start_say_why_in_their_status(pair: tuple[IOEngine, IOEngine]) -> None:
    """Refused before posting: the code and MoRI-IO's message, or the bad block named."""
    a, b = pair
    _, mx = register(a, 256)
    _, my = register(b, 256)
    bad = a.write(mx, 200, my, 0, 100)
    assert (bad.Code(), bad.Message()) == (StatusCode.ERR_INVALID_ARGS, "length out of range")  # MoRI-IO's words
    a.deregister_remote_engine(b.get_engine_desc())
    unknown = a.write(mx, 0, my, 0, 8)
    assert (unknown.Code(), unknown.Message()) == (StatusCode.ERR_BAD_STATE, NO_BACKEND)


def test_an_engine_level_write_to_an_engine_that_is_gone_fails_with_the_reason() -> None:
    a, b = make_pair("gone", "tcp")
    try:
        _, mx = register(a, 64)
        _, my = register(b, 64)
        b.close()  # still registered with a: the call is accepted, and opening its session fails
        st = a.write(mx, 0, my, 0, 64)
        assert st.WaitFor(10_000) is StatusCode.ERR_RDMA_OP
        assert st.Message().startswith(f"create_session to engine {b.key!r} failed: ")
    finally:
        a.close()


def test_an_engine_level_write_of_zero_bytes_is_posted_and_filed_at_the_target(pair: tuple[IOEngine, IOEngine]) -> None:
    """Only an engine-level *batch* with nothing in it succeeds unannounced (MoRI-IO); a single call of size 0
    goes to the target like any other, so its uid is filed there."""
    a, b = pair
    _, mx = register(a, 64)
    _, my = register(b, 64)
    uid = a.allocate_transfer_uid()
    assert a.write(mx, 0, my, 0, 0, uid).WaitFor(10_000) is StatusCode.SUCCESS
    deadline = time.monotonic() + 5
    while (inbound := b.pop_inbound_transfer_status(a.key, uid)) is None:
        assert time.monotonic() < deadline, "the target never filed the zero-byte write"
        time.sleep(0.001)
    assert inbound.Succeeded()


def test_a_session_keeps_its_engine_alive_after_the_caller_dropped_it() -> None:
    a, b = make_pair("owned", "tcp")
    try:
        x, mx = register(a, 64)
        y, my = register(b, 64, fill=0)
        session = a.create_session(mx, my)
        assert session is not None
        engine = weakref.ref(a)
        del a
        gc.collect()
        assert engine() is not None, "the engine was collected under its live session (and closed)"
        assert session.write(0, 0, 64).WaitFor(10_000) is StatusCode.SUCCESS and np.array_equal(x, y)
    finally:
        if (left := engine()) is not None:
            left.close()
        b.close()


def test_the_default_config_listens_on_loopback_at_a_free_port() -> None:
    """``IOEngineConfig()``, as MoRI-IO's examples write it: host "" is 127.0.0.1, port 0 a free one."""
    config = IOEngineConfig()
    assert repr(config) == "IOEngineConfig(host='', port=0)"
    engine = IOEngine("defaults", config)
    try:
        desc = engine.get_engine_desc()
        assert desc.host == "127.0.0.1" and desc.port > 0
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("value", "on"), [("1", True), ("TRUE", True), (" on ", True), ("yes", True), ("0", False), ("off", False)]
)
def test_mori_io_enable_notification_from_the_environment(
    value: str, on: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MoRI-IO's ``MORI_IO_ENABLE_NOTIFICATION``, read case-blind and trimmed, overrides the config's field."""
    monkeypatch.setenv("MORI_IO_ENABLE_NOTIFICATION", value)
    assert RdmaBackendConfig(enable_notification=not on).effective().enable_notification is on


def test_the_smallest_valid_config_passes_and_the_checks_say_mori_ios_words(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MORI_IO_ENABLE_NOTIFICATION", raising=False)
    assert RdmaBackendConfig(max_chunks_per_transfer=1, notif_per_qp=1).effective().max_chunks_per_transfer == 1
    with pytest.raises(RuntimeError) as info:
        RdmaBackendConfig(notif_per_qp=0).effective()
    assert str(info.value) == "Invalid RDMA config: notifPerQp must be >= 1 when notification is enabled"
    assert RdmaBackendConfig(notif_per_qp=0, enable_notification=False).effective().notif_per_qp == 0
