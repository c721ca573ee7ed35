"""Descriptors that travel between engines: who an engine is, and what memory it exports.

``pack()`` gives bytes to hand to a peer by any means (MoRI-IO's explicit
style); ``unpack()`` checks every field, since the bytes came from elsewhere.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from .errors import InvalidArgument
from .status import Access

__all__ = ["EngineDesc", "MemoryDesc", "new_incarnation"]

_U64 = (1 << 64) - 1
_RANDOM_BITS = 10
_last_incarnation = 0
_incarnation_lock = threading.Lock()


def new_incarnation() -> int:
    """A fresh engine incarnation, ordered by start time: later starts get larger numbers.

    Microseconds since the epoch shifted left by 10 random bits (below 2**63
    until the year 2255), and strictly increasing within a process. Peers
    compare incarnations: a hello from an older incarnation of a known engine
    is refused, a newer one supersedes it.
    """
    global _last_incarnation
    value = (time.time_ns() // 1000) << _RANDOM_BITS | secrets.randbits(_RANDOM_BITS)
    with _incarnation_lock:
        value = _last_incarnation = max(value, _last_incarnation + 1)
    return value & ((1 << 63) - 1)


def _field(data: dict[str, Any], name: str, kind: type) -> Any:
    value = data.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InvalidArgument(f"descriptor field {name!r} is missing or not {kind.__name__}")
    return value


def _load(raw: bytes | str, what: str) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"cannot unpack {what}: {exc}") from exc
    if not isinstance(data, dict) or data.get("kind") != what:
        raise InvalidArgument(f"cannot unpack {what}: not a packed {what}")
    return data


@dataclass(frozen=True, slots=True)
class EngineDesc:
    """An engine as its peers see it. ``incarnation`` changes at every engine start."""

    key: str
    host: str
    port: int
    incarnation: int
    backend: str

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "EngineDesc", **asdict(self)}

    def pack(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineDesc:
        desc = cls(
            key=_field(data, "key", str),
            host=_field(data, "host", str),
            port=_field(data, "port", int),
            incarnation=_field(data, "incarnation", int),
            backend=_field(data, "backend", str),
        )
        if not 0 <= desc.port <= 0xFFFF or not 0 <= desc.incarnation <= _U64:
            raise InvalidArgument("EngineDesc has an out-of-range port or incarnation")
        return desc

    @classmethod
    def unpack(cls, raw: bytes | str) -> EngineDesc:
        data = _load(raw, "EngineDesc")
        return cls.from_dict(data)


@dataclass(frozen=True, slots=True)
class MemoryDesc:
    """A registered region: enough for a peer to target it with one-sided operations.

    ``addr`` is the region's address in its owner's process, as with verbs, so
    a remote offset becomes ``addr + offset`` on the wire.
    """

    engine_key: str
    incarnation: int
    name: str
    addr: int
    length: int
    rkey: int
    access: Access

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["access"] = int(self.access)
        return {"kind": "MemoryDesc", **data}

    def pack(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryDesc:
        desc = cls(
            engine_key=_field(data, "engine_key", str),
            incarnation=_field(data, "incarnation", int),
            name=_field(data, "name", str),
            addr=_field(data, "addr", int),
            length=_field(data, "length", int),
            rkey=_field(data, "rkey", int),
            access=Access(_field(data, "access", int) & int(Access.all())),
        )
        if not (0 <= desc.addr <= _U64 and 0 < desc.length <= _U64 and 0 <= desc.rkey < 1 << 32):
            raise InvalidArgument("MemoryDesc has an out-of-range addr, length or rkey")
        return desc

    @classmethod
    def unpack(cls, raw: bytes | str) -> MemoryDesc:
        return cls.from_dict(_load(raw, "MemoryDesc"))
