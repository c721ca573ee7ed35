"""compat.vllm: vLLM's MoRIIO wrapper surface, its config keys, merge rule and TransferError lines."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

from moriio_async import IOEngine as AsyncEngine
from moriio_async import IOEngineConfig as AsyncEngineConfig
from moriio_async.compat.mori import BackendType, IOEngine, RdmaBackendConfig, StatusCode
from moriio_async.compat.vllm import (
    AsyncMoRIIOWrapper,
    MoRIIOConfig,
    MoRIIOConstants,
    MoRIIOError,
    MoRIIOMode,
    MoRIIOWrapper,
    TransferError,
    get_moriio_mode,
    get_port_offset,
    merge_contiguous_blocks,
)

from .conftest import make_pair, on_loop


def test_merge_contiguous_blocks() -> None:
    assert merge_contiguous_blocks([], [], []) == ([], [], [])
    assert merge_contiguous_blocks([0, 4, 8], [100, 104, 108], [4, 4, 4]) == ([0], [100], [12])
    assert merge_contiguous_blocks([8, 0], [50, 10], [4, 4]) == ([0, 8], [10, 50], [4, 4])  # none: sorted input back
    # sorted by local offset; a run breaks where either side has a gap
    assert merge_contiguous_blocks([8, 0, 4, 20], [8, 0, 4, 40], [4, 4, 4, 4]) == ([0, 20], [0, 40], [12, 4])
    assert merge_contiguous_blocks([0, 4], [0, 5], [4, 4]) == ([0, 4], [0, 5], [4, 4])
    assert merge_contiguous_blocks(np.array([0, 4]), np.array([0, 4]), np.array([4, 4])) == ([0], [0], [8])
    with pytest.raises(ValueError, match="Input list lengths mismatch"):
        merge_contiguous_blocks([0], [0, 1], [1])


def test_extra_config_defaults_and_port_offsets() -> None:
    cfg = MoRIIOConfig.from_extra_config({}, dp_rank=1, tp_rank=2, tp_size=4)
    assert cfg.handshake_port == int(MoRIIOConstants.DEFAULT_HANDSHAKE_PORT) == 6301
    assert cfg.notify_port == 61005 + 1 + 2  # vLLM's offset: dp_rank + tp_rank (no tp_size)
    assert cfg.handshake_port_for(1) == 6301 + 3 and cfg.handshake_port_for(0, 1) == 6302
    assert (cfg.transfer_timeout, cfg.defer_timeout, cfg.read_mode) == (30.0, 60.0, False)
    assert (cfg.qp_per_transfer, cfg.post_batch_size, cfg.num_workers, cfg.backend) == (1, -1, 1, "rdma")
    cfg = MoRIIOConfig.from_extra_config(
        {
            "read_mode": " True",
            "handshake_port": "7000",
            "notify_port": 0,
            "transfer_timeout": "5",
            "qp_per_transfer": 4,
        }
    )
    assert cfg.read_mode and cfg.handshake_port == 7000 and cfg.notify_port == 61005 and cfg.transfer_timeout == 5
    assert get_moriio_mode({"read_mode": "1"}) is MoRIIOMode.READ and get_moriio_mode({}) is MoRIIOMode.WRITE
    assert get_port_offset(2, 3, tp_size=4) == 11
    with pytest.raises(ValueError, match="must be one of 'rdma' or 'xgmi'"):
        MoRIIOConfig.from_extra_config({"backend": "nvlink"})


@pytest.fixture
def wrapped() -> Iterator[tuple[MoRIIOWrapper, IOEngine, np.ndarray, np.ndarray]]:
    a, b = make_pair("vllm", "mock", hold=True)
    wrapper = MoRIIOWrapper(transfer_timeout=1.0)
    wrapper.set_moriio_engine(a)
    local, remote = np.zeros(8192, dtype=np.uint8), np.arange(8192, dtype=np.uint8)
    local_desc = wrapper.get_unpack_memory_metadata(wrapper.register_local_tensor(local))
    remote_desc = wrapper.get_unpack_memory_metadata(b.register_torch_tensor(remote).pack())
    wrapper.sessions.append(wrapper.build_session(local_desc, remote_desc))
    yield wrapper, a, local, remote
    a.close()
    b.close()


def release(engine: IOEngine, wrapper: MoRIIOWrapper) -> None:
    for stripe in wrapper.sessions[0].stripes:
        on_loop(engine, stripe.channel.qp.step, 1 << 20)


def test_transfer_error_lines_as_vllm_prints_them(
    wrapped: tuple[MoRIIOWrapper, IOEngine, np.ndarray, np.ndarray],
) -> None:
    wrapper, engine, _, _ = wrapped
    session = wrapper.sessions[0]
    ok = wrapper.read_remote_data([1024], [0], [0], session)
    release(engine, wrapper)
    ok.Wait()
    bad = wrapper.read_remote_data([1024], [0], [8000], session)  # out of range: fails at once
    held = wrapper.write_remote_data([16], [0], [0], session)  # nobody steps the queue pair: it times out
    with pytest.raises(TransferError) as info:
        wrapper.waiting_for_transfer_complete([ok, bad, held])
    assert str(info.value) == (
        "2/3 transfers failed:\n"
        "RDMA transfer failed: length out of range (code=StatusCode.ERR_INVALID_ARGS)\n"
        "RDMA transfer timed out after 1s. Check NIC queue depth or reduce concurrency; "
        "adjust with kv_connector_extra_config.transfer_timeout."
    )
    assert isinstance(info.value, MoRIIOError)
    release(engine, wrapper)
    assert held.WaitFor(5000) is StatusCode.SUCCESS


def test_wait_with_no_list_takes_this_wrappers_unwaited_transfers(
    wrapped: tuple[MoRIIOWrapper, IOEngine, np.ndarray, np.ndarray],
) -> None:
    wrapper, engine, local, remote = wrapped
    other = MoRIIOWrapper(engine, transfer_timeout=1.0)
    other.local_memory_registered = True
    session = wrapper.sessions[0]
    first = wrapper.read_remote_data([4096], [0], [0], session)
    second = wrapper.write_remote_data_single(16, 0, 8000, 0)
    mine = other.read_remote_data([16], [4096], [4096], session)
    assert len(wrapper.transfer_status) == 2 and len(other.transfer_status) == 1
    release(engine, wrapper)
    wrapper.waiting_for_transfer_complete([second])  # waited for: no longer pending
    assert wrapper.transfer_status == [first]
    wrapper.waiting_for_transfer_complete()
    assert first.Succeeded() and wrapper.transfer_status == []
    assert np.array_equal(local[:4096], remote[:4096])
    assert other.transfer_status == [mine]  # another wrapper's transfer is not this wrapper's business
    wrapper.waiting_for_transfer_complete()  # nothing left: returns at once
    other.waiting_for_transfer_complete()
    assert mine.Succeeded()


def test_wrapper_checks_and_backend_settings() -> None:
    wrapper = MoRIIOWrapper()
    with pytest.raises(MoRIIOError, match="must be set first"):
        wrapper.get_agent_metadata()
    a, b = make_pair("vllm-set", "tcp")
    try:
        wrapper.set_moriio_engine(a)
        with pytest.raises(MoRIIOError, match="not register local memory"):
            wrapper.read_remote_data([8], [0], [0], None)
        assert wrapper.register_remote_engine(b.get_engine_desc().pack()) == b.key
        with pytest.raises(MoRIIOError, match="Failed to register local memory"):
            wrapper.register_local_tensor(b"read-only bytes")
        fresh = IOEngine("vllm-fresh")
        try:
            MoRIIOWrapper(fresh).set_backend_type(BackendType.RDMA, qp_per_transfer=2, post_batch_size=8)
            assert fresh.aio.transports[-1] == "tcp"  # auto: cma and verbs where they open, then tcp
        finally:
            fresh.close()
    finally:
        a.close()
        b.close()


def test_wrapper_from_threads() -> None:
    a, b = make_pair("vllm-threads", "tcp", RdmaBackendConfig(qp_per_transfer=2))
    try:
        wrapper = MoRIIOWrapper(a)
        local, remote = np.zeros(1 << 20, dtype=np.uint8), np.random.default_rng(1).integers(0, 256, 1 << 20, np.uint8)
        local_desc = wrapper.get_unpack_memory_metadata(wrapper.register_local_tensor(local))
        remote_desc = b.register_torch_tensor(remote)
        session = wrapper.build_session(local_desc, remote_desc)
        failures: list[BaseException] = []

        def worker(t: int) -> None:
            try:
                for r in range(20):
                    base = (t * 20 + r) * 4096
                    lo, ro, sz = merge_contiguous_blocks([base, base + 2048], [base, base + 2048], [2048, 2048])
                    wrapper.waiting_for_transfer_complete([wrapper.read_remote_data(sz, lo, ro, session)])
            except BaseException as exc:
                failures.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not failures and wrapper.transfer_status == []
        assert np.array_equal(local[: 160 * 4096], remote[: 160 * 4096])
    finally:
        a.close()
        b.close()


async def test_async_wrapper_lines_and_pending() -> None:
    config = AsyncEngineConfig(backend="mock", backend_extra={"hold": True})
    async with AsyncEngine("vllm-async-a", config) as a, AsyncEngine("vllm-async-b", config) as b:
        local, remote = bytearray(4096), bytearray(range(256)) * 16
        remote_desc = b.register_memory(remote, name="kv")
        peer = await a.connect(b.address)
        wrapper = AsyncMoRIIOWrapper(a, transfer_timeout=0.2)
        wrapper.sessions.append(await wrapper.build_session(a.register_memory(local), peer.memory["kv"]))
        assert remote_desc == peer.memory["kv"]
        session = wrapper.sessions[0]
        ok = wrapper.read_remote_data([1024], [0], [0], session)
        session.channel.qp.step(1)
        held = wrapper.write_remote_data_single(16, 0, 0, 0)
        with pytest.raises(TransferError) as info:
            await wrapper.waiting_for_transfer_complete()
        assert str(info.value).splitlines() == [
            "1/2 transfers failed:",
            "RDMA transfer timed out after 0s. Check NIC queue depth or reduce concurrency; "
            "adjust with kv_connector_extra_config.transfer_timeout.",
        ]
        assert ok.Succeeded() and local[:1024] == remote[:1024] and wrapper.transfer_status == []
        session.channel.qp.step(1)
        await held
