"""``EngineDesc`` and ``MemoryDesc`` with MoRI-IO's field names, ``pack()``/``unpack()`` and ``==``.

Each also carries what moriio_async needs to reach the engine or the region
(incarnation, backend, rkey, access); ``inner`` gives the moriio_async
descriptor. Packed bytes are JSON (not MoRI-IO's msgpack): they travel between
moriio_async engines only. ``unpack`` checks every field, since the bytes
came from elsewhere.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass
from typing import Any

from moriio_async import Access, InvalidArgument
from moriio_async import EngineDesc as AsyncEngineDesc
from moriio_async import MemoryDesc as AsyncMemoryDesc

from .enums import MemoryLocationType

__all__ = ["IPC_HANDLE_SIZE", "EngineDesc", "MemoryDesc", "node_id"]

IPC_HANDLE_SIZE = 64
_U64 = (1 << 64) - 1


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


def _get(data: dict[str, Any], name: str, kind: type) -> Any:
    value = data.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InvalidArgument(f"descriptor field {name!r} is missing or not {kind.__name__}")
    return value


def _load(raw: bytes | str, kind: str) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"cannot unpack {kind}: {exc}") from exc
    if not isinstance(data, dict) or data.get("kind") != f"mori.{kind}":
        raise InvalidArgument(f"cannot unpack {kind}: not a packed {kind}")
    return data


@dataclass(frozen=True, slots=True)
class EngineDesc:
    """An engine as its peers see it (MoRI-IO's fields first)."""

    key: str
    node_id: str
    hostname: str
    host: str
    port: int
    pid: int
    incarnation: int
    """Changes at every engine start (not in MoRI-IO): a restarted peer is never reached through stale handles."""
    backend: str

    @classmethod
    def of(cls, inner: AsyncEngineDesc) -> EngineDesc:
        return cls(inner.key, node_id(), socket.gethostname(), inner.host, inner.port, os.getpid(),
                   inner.incarnation, inner.backend)  # fmt: skip

    @property
    def inner(self) -> AsyncEngineDesc:
        return AsyncEngineDesc(self.key, self.host, self.port, self.incarnation, self.backend)

    def pack(self) -> bytes:
        return json.dumps({"kind": "mori.EngineDesc", **asdict(self)}, separators=(",", ":")).encode()

    @staticmethod
    def unpack(raw: bytes | str) -> EngineDesc:
        data = _load(raw, "EngineDesc")
        inner = AsyncEngineDesc.from_dict(
            {k: data.get(k) for k in ("key", "host", "port", "incarnation", "backend")}
        )  # checks ranges
        return EngineDesc(
            inner.key,
            _get(data, "node_id", str),
            _get(data, "hostname", str),
            inner.host,
            inner.port,
            _get(data, "pid", int),
            inner.incarnation,
            inner.backend,
        )


@dataclass(frozen=True, slots=True)
class MemoryDesc:
    """A registered region (MoRI-IO's fields first). ``data`` is its address in its owner's process."""

    engine_key: str
    id: int
    device_id: int
    device_bus_id: str
    data: int
    size: int
    loc: MemoryLocationType
    ipc_handle: bytes
    numa_node: int
    incarnation: int
    rkey: int
    access: int
    rkeys: tuple[tuple[str, int], ...] = ()
    """The rkey on each backend when the owner has several (not in MoRI-IO): a peer reaching it over
    another transport than the owner's first (tcp from another host) names that backend's rkey."""

    @property
    def inner(self) -> AsyncMemoryDesc:
        return AsyncMemoryDesc(
            self.engine_key, self.incarnation, "", self.data, self.size, self.rkey, Access(self.access), self.rkeys
        )

    def pack(self) -> bytes:
        data = asdict(self)
        data["loc"] = int(self.loc)
        data["ipc_handle"] = self.ipc_handle.hex()
        data["rkeys"] = dict(self.rkeys)
        return json.dumps({"kind": "mori.MemoryDesc", **data}, separators=(",", ":")).encode()

    @staticmethod
    def unpack(raw: bytes | str) -> MemoryDesc:
        data = _load(raw, "MemoryDesc")
        try:
            ipc = bytes.fromhex(_get(data, "ipc_handle", str))
            loc = MemoryLocationType(_get(data, "loc", int))
        except ValueError as exc:
            raise InvalidArgument(f"cannot unpack MemoryDesc: {exc}") from exc
        rkeys = AsyncMemoryDesc.from_dict(
            {"engine_key": "?", "incarnation": 0, "name": "", "addr": 0, "length": 1, "rkey": 0, "access": 0,
             "rkeys": data.get("rkeys", {})}
        ).rkeys  # fmt: skip
        desc = MemoryDesc(
            _get(data, "engine_key", str),
            _get(data, "id", int),
            _get(data, "device_id", int),
            _get(data, "device_bus_id", str),
            _get(data, "data", int),
            _get(data, "size", int),
            loc,
            ipc,
            _get(data, "numa_node", int),
            _get(data, "incarnation", int),
            _get(data, "rkey", int),
            _get(data, "access", int) & int(Access.all()),
            rkeys,
        )
        if len(ipc) != IPC_HANDLE_SIZE or not 0 <= desc.id < 1 << 32:
            raise InvalidArgument("MemoryDesc has a malformed ipc_handle or id")
        AsyncMemoryDesc.from_dict(desc.inner.to_dict())  # range checks: addr, size, rkey, incarnation
        return desc
