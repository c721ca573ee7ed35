"""``EngineDesc`` and ``MemoryDesc`` with MoRI-IO's field names, ``pack()``/``unpack()`` and ``==``.

Each wraps the moriio_async descriptor (``inner``: what moriio_async needs to
reach the engine or the region: incarnation, backend, rkey, access) and adds
MoRI-IO's own fields; the shared ones read through to ``inner``. Packed bytes
are JSON (not MoRI-IO's msgpack): they travel between moriio_async engines
only. ``unpack`` checks every field, with the bounds the descriptors declare,
since the bytes came from elsewhere.
"""

from __future__ import annotations

import os
import socket
from typing import Annotated

import msgspec

from moriio_async import EngineDesc as AsyncEngineDesc
from moriio_async import MemoryDesc as AsyncMemoryDesc
from moriio_async.descriptors import U32, Descriptor, Short

from .enums import MemoryLocationType

__all__ = ["IPC_HANDLE_SIZE", "EngineDesc", "MemoryDesc", "node_id"]

IPC_HANDLE_SIZE = 64
_I32 = Annotated[int, msgspec.Meta(ge=-(1 << 31), lt=1 << 31)]


def node_id() -> str:
    """MoRI-IO's node identity: ``MORI_NODE_ID``, else the kernel boot id, else the host name."""
    override = os.environ.get("MORI_NODE_ID")
    if override is not None:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return boot or socket.gethostname()


class EngineDesc(Descriptor, frozen=True):
    """An engine as its peers see it: MoRI-IO's identity fields around moriio_async's descriptor."""

    KIND = "mori.EngineDesc"

    inner: AsyncEngineDesc
    """Without transports, as MoRI-IO's descriptor names one backend: the peer's hello tells the rest."""
    node_id: Short
    hostname: Short
    pid: U32

    @classmethod
    def of(cls, inner: AsyncEngineDesc) -> EngineDesc:
        return cls(msgspec.structs.replace(inner, transports=()), node_id(), socket.gethostname(), os.getpid())

    @property
    def key(self) -> str:
        return self.inner.key

    @property
    def host(self) -> str:
        return self.inner.host

    @property
    def port(self) -> int:
        return self.inner.port

    @property
    def incarnation(self) -> int:
        """Changes at every engine start (not in MoRI-IO): a restarted peer is never reached through stale handles."""
        return self.inner.incarnation

    @property
    def backend(self) -> str:
        return self.inner.backend


class MemoryDesc(Descriptor, frozen=True, kw_only=True):
    """A registered region: MoRI-IO's fields around moriio_async's descriptor of it.

    ``data`` is the region's address in its owner's process, ``size`` its length.
    """

    KIND = "mori.MemoryDesc"

    inner: AsyncMemoryDesc
    id: U32
    device_id: _I32
    device_bus_id: Short
    loc: MemoryLocationType
    ipc_handle: Annotated[bytes, msgspec.Meta(min_length=IPC_HANDLE_SIZE, max_length=IPC_HANDLE_SIZE)]
    numa_node: _I32

    @property
    def engine_key(self) -> str:
        return self.inner.engine_key

    @property
    def data(self) -> int:
        return self.inner.addr

    @property
    def size(self) -> int:
        return self.inner.length

    @property
    def incarnation(self) -> int:
        return self.inner.incarnation

    @property
    def rkey(self) -> int:
        return self.inner.rkey

    @property
    def access(self) -> int:
        return int(self.inner.access)

    @property
    def rkeys(self) -> dict[str, int]:
        """The rkey on each backend when the owner has several (not in MoRI-IO): a peer reaching it over
        another transport than the owner's first (tcp from another host) names that backend's rkey."""
        return self.inner.rkeys
