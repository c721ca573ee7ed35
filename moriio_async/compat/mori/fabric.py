"""MoRI-IO's fabric memory names (``fabric_alloc``, ``fabric_free``, the fabric torch allocator) and
``TORCH_DEVICE_TYPE_MAP``.

In MoRI-IO, ``fabric_alloc(size, device)`` returns GPU memory (a VMM allocation
exportable over a UALink fabric) for its FABRIC backend, and the torch
allocator functions route torch's CUDA allocations there. moriio_async has no
GPU and no fabric backend, so:

- ``fabric_alloc(size, -1)`` (device -1: host memory, as MoRI-IO's
  ``register_memory`` spells it) returns the address of ``size`` zeroed,
  page-aligned bytes of host memory that ``IOEngine.register_memory(ptr, size,
  -1, MemoryLocationType.CPU)`` accepts; ``fabric_free(ptr)`` releases it
  (once every engine that registered it has deregistered it: a registration
  keeps the mapping alive, so a transfer never touches unmapped memory).
- a GPU ``device`` (>= 0) and the torch allocator functions raise
  ``FabricUnsupported``, naming what is unsupported and what to use instead.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from typing import NoReturn

from moriio_async import InvalidArgument, MoriioError

from .enums import MemoryLocationType

__all__ = [
    "TORCH_DEVICE_TYPE_MAP",
    "FabricUnsupported",
    "fabric_alloc",
    "fabric_allocation",
    "fabric_free",
    "fabric_mem_pool",
    "fabric_torch_allocator",
    "make_fabric_mem_pool",
    "use_fabric_torch_allocator",
]

TORCH_DEVICE_TYPE_MAP = {"cpu": MemoryLocationType.CPU, "cuda": MemoryLocationType.GPU}
"""A torch device type to its memory location, as in MoRI-IO (``register_memory`` refuses GPU memory here)."""


class FabricUnsupported(MoriioError, NotImplementedError):
    """A fabric (GPU over UALink) feature of MoRI-IO that moriio_async does not have."""


_HOST_HINT = (
    "moriio_async moves host memory only: use fabric_alloc(size, -1) for host memory, or allocate CPU "
    "tensors with torch as usual and register them with register_torch_tensor"
)

_lock = threading.Lock()
_allocations: dict[int, mmap.mmap] = {}
"""Live host allocations by address."""


def fabric_alloc(size: int, device: int) -> int:
    """``size`` zeroed bytes of host memory for ``device == -1``: their address (see the module docstring)."""
    if isinstance(device, bool) or not isinstance(device, int) or device < -1:
        raise InvalidArgument(f"fabric_alloc: device must be -1 (host) or a GPU ordinal, not {device!r}")
    if device >= 0:
        raise FabricUnsupported(
            f"fabric_alloc(size, device={device}): fabric memory is GPU memory exported over a UALink fabric, "
            "and moriio_async has no GPU or fabric backend",
            hint=_HOST_HINT,
        )
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise InvalidArgument(f"fabric_alloc: size must be a positive int, not {size!r}")
    buffer = mmap.mmap(-1, size)  # anonymous: zeroed and page-aligned
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buffer))  # the temporary export ends at once
    with _lock:
        _allocations[addr] = buffer
    return addr


def fabric_free(ptr: int) -> None:
    """Release an allocation of ``fabric_alloc``; its memory stays mapped while an engine still registers it."""
    with _lock:
        buffer = _allocations.pop(ptr, None)
    if buffer is None:
        raise InvalidArgument(f"fabric_free: {ptr!r} is not an address fabric_alloc returned (or it was freed)")


def fabric_allocation(ptr: int, size: int) -> mmap.mmap | None:
    """The live ``fabric_alloc`` allocation holding ``[ptr, ptr + size)``, if any (a registration keeps it)."""
    with _lock:
        for addr, buffer in _allocations.items():
            if addr <= ptr and ptr + size <= addr + len(buffer):
                return buffer
    return None


def _no_torch_allocator(name: str) -> NoReturn:
    raise FabricUnsupported(
        f"{name}: a torch CUDA allocator for fabric-exportable GPU memory; moriio_async has no GPU or fabric "
        "backend, and CPU tensors need no special allocator",
        hint=_HOST_HINT,
    )


def fabric_torch_allocator() -> NoReturn:
    _no_torch_allocator("fabric_torch_allocator()")


def use_fabric_torch_allocator() -> NoReturn:
    _no_torch_allocator("use_fabric_torch_allocator()")


def make_fabric_mem_pool() -> NoReturn:
    _no_torch_allocator("make_fabric_mem_pool()")


def fabric_mem_pool() -> NoReturn:
    """MoRI-IO's context manager (``with fabric_mem_pool() as pool:``); raises when called."""
    _no_torch_allocator("fabric_mem_pool()")
