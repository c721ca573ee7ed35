"""Registering the caller's buffers with the device (``ibv_reg_mr`` on the buffer's own address)."""

from __future__ import annotations

import ctypes
import errno
from dataclasses import dataclass

from ...errors import InvalidArgument, MoriioError
from ...status import Access
from ..base import MemoryRegion
from ._pyverbs import MrHandle, PdHandle
from .facts import memlock_limit
from .values import VerbsError

__all__ = ["VerbsMemoryRegion", "deregister", "register"]


@dataclass(eq=False, slots=True)
class VerbsMemoryRegion(MemoryRegion):
    handle: MrHandle | None = None
    pin: ctypes.Array[ctypes.c_char] | None = None
    """A ctypes view of the buffer: it holds a buffer export, so the buffer cannot be
    resized or freed under the NIC while registered (``bytearray`` raises BufferError)."""


def register(pd: PdHandle, buffer: memoryview, access: Access) -> VerbsMemoryRegion:
    if access & Access.REMOTE_WRITE and not access & Access.LOCAL_WRITE:
        raise InvalidArgument("REMOTE_WRITE access needs LOCAL_WRITE too (as ibv_reg_mr requires)")
    length = buffer.nbytes
    try:
        pin = (ctypes.c_char * length).from_buffer(buffer)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"cannot register this buffer: {exc}") from exc
    addr = ctypes.addressof(pin)
    try:
        handle = MrHandle(pd, addr, length, int(access))
    except VerbsError as exc:
        if exc.errno in (errno.ENOMEM, errno.EPERM, errno.EAGAIN):
            limit = memlock_limit()
            shown = "unlimited" if limit is None else f"{limit} bytes"
            raise MoriioError(
                f"registering {length} bytes failed: {exc} (RLIMIT_MEMLOCK is {shown})",
                hint="raise the locked-memory limit: `ulimit -l unlimited`, or LimitMEMLOCK=infinity "
                "for a systemd service, or --ulimit memlock=-1 for a container",
            ) from exc
        raise
    return VerbsMemoryRegion(
        addr=addr,
        length=length,
        lkey=handle.lkey,
        rkey=handle.rkey,
        access=access,
        view=buffer,
        handle=handle,
        pin=pin,
    )


def deregister(region: MemoryRegion) -> None:
    """Deregister; a region already deregistered (or freed by closing the backend) is left as is."""
    if not isinstance(region, VerbsMemoryRegion):
        raise InvalidArgument("not a region of the verbs backend")
    if region.handle is None:
        return
    handle, region.handle = region.handle, None
    try:
        handle.close()
    finally:
        region.pin = None
