"""MoRI-IO's fabric names and ``TORCH_DEVICE_TYPE_MAP``, as MoRI-IO's own benchmark imports them: host memory
works, GPU (fabric) memory and the fabric torch allocator raise ``FabricUnsupported`` saying so."""

from __future__ import annotations

import ctypes
import gc
import re
from collections.abc import Callable

import numpy as np
import pytest

from moriio_async import InvalidArgument, MoriioError
from moriio_async.compat.mori import (
    TORCH_DEVICE_TYPE_MAP,
    FabricUnsupported,
    IOEngine,
    MemoryLocationType,
    StatusCode,
    fabric_alloc,
    fabric_free,
    fabric_mem_pool,
    fabric_torch_allocator,
    make_fabric_mem_pool,
    use_fabric_torch_allocator,
)

SIZE = 64 << 10


def view(ptr: int, size: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(ptr))


def test_torch_device_type_map_is_mori_ios() -> None:
    assert TORCH_DEVICE_TYPE_MAP == {"cpu": MemoryLocationType.CPU, "cuda": MemoryLocationType.GPU}


def test_a_cpu_tensor_registers_by_pointer_with_the_map(pair: tuple[IOEngine, IOEngine]) -> None:
    torch = pytest.importorskip("torch")
    a, _ = pair
    tensor = torch.zeros(SIZE, dtype=torch.uint8)
    where = TORCH_DEVICE_TYPE_MAP[tensor.device.type]
    desc = a.register_memory(tensor.data_ptr(), SIZE, -1, where)
    assert (desc.data, desc.size, desc.loc) == (tensor.data_ptr(), SIZE, MemoryLocationType.CPU)
    with pytest.raises(RuntimeError, match="GPU backend"):
        a.register_memory(tensor.data_ptr(), SIZE, 0, TORCH_DEVICE_TYPE_MAP["cuda"])
    a.deregister_memory(desc)


def test_host_fabric_memory_is_registered_and_moved_and_outlives_fabric_free_while_registered(
    pair: tuple[IOEngine, IOEngine],
) -> None:
    a, b = pair
    src, dst = fabric_alloc(SIZE, -1), fabric_alloc(SIZE, -1)
    assert src % 4096 == 0 and not view(src, SIZE).any()  # page-aligned, zeroed
    view(src, SIZE)[:] = np.arange(SIZE) % 251
    mem_src = b.register_memory(src, SIZE, -1, MemoryLocationType.CPU)
    mem_dst = a.register_memory(dst, SIZE, -1, MemoryLocationType.CPU)
    session = a.create_session(mem_dst, mem_src)
    assert session is not None
    fabric_free(src)  # still registered by b: its memory stays mapped until b deregisters it
    gc.collect()
    assert session.read(0, 0, SIZE).WaitFor(10_000) is StatusCode.SUCCESS
    assert (view(dst, SIZE) == np.arange(SIZE) % 251).all()
    b.deregister_memory(mem_src)
    a.deregister_memory(mem_dst)
    fabric_free(dst)
    with pytest.raises(InvalidArgument, match="not an address fabric_alloc returned"):
        fabric_free(dst)


def test_fabric_alloc_of_gpu_memory_and_bad_input_say_what_is_unsupported() -> None:
    said = (
        "fabric_alloc(size, device=0): fabric memory is GPU memory exported over a UALink fabric, and moriio_async "
        "has no GPU or fabric backend"
    )
    with pytest.raises(FabricUnsupported, match=f"^{re.escape(said)}") as e:
        fabric_alloc(SIZE, 0)
    assert isinstance(e.value, NotImplementedError) and isinstance(e.value, MoriioError)
    assert e.value.hint is not None and "fabric_alloc(size, -1)" in e.value.hint
    bad = "fabric_alloc: size must be a positive int, not {!r}"
    bad_device = "fabric_alloc: device must be -1 (host) or a GPU ordinal, not {!r}"
    for size, device, message in (
        (0, -1, bad.format(0)),
        (-5, -1, bad.format(-5)),
        (1.0, -1, bad.format(1.0)),
        (True, -1, bad.format(True)),
        (SIZE, -2, bad_device.format(-2)),
        (SIZE, 1.0, bad_device.format(1.0)),
        (SIZE, False, bad_device.format(False)),
    ):
        with pytest.raises(InvalidArgument, match=f"^{re.escape(message)}"):
            fabric_alloc(size, device)  # type: ignore[arg-type]
    fabric_free(fabric_alloc(1, -1))  # one byte is a size like any other


@pytest.mark.parametrize(
    "call", [fabric_torch_allocator, use_fabric_torch_allocator, make_fabric_mem_pool, fabric_mem_pool]
)
def test_the_fabric_torch_allocator_functions_raise_naming_themselves(call: Callable[[], object]) -> None:
    said = (
        f"{call.__name__}(): a torch CUDA allocator for fabric-exportable GPU memory; moriio_async has no GPU or "
        "fabric backend, and CPU tensors need no special allocator"
    )
    with pytest.raises(FabricUnsupported, match=f"^{re.escape(said)}") as e:
        call()
    assert e.value.hint is not None and "register_torch_tensor" in e.value.hint


def test_every_name_mori_ios_benchmark_imports_from_mori_io_is_there() -> None:
    """tests/python/io/benchmark.py in ROCm/mori imports these from ``mori.io``."""
    import moriio_async.compat.mori as mori_io

    names = [
        "IOEngineConfig",
        "BackendType",
        "IOEngine",
        "EngineDesc",
        "MemoryDesc",
        "MemoryLocationType",
        "PollCqMode",
        "RdmaBackendConfig",
        "XgmiBackendConfig",
        "FabricBackendConfig",
        "fabric_alloc",
        "set_log_level",
    ]
    assert [n for n in names if not hasattr(mori_io, n)] == []
