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

__all__ = ["MAX_TRANSPORTS", "EngineDesc", "MemoryDesc", "TransportDesc", "new_incarnation"]

_U64 = (1 << 64) - 1
MAX_TRANSPORTS = 4
"""Most transports an engine advertises (one per backend kind)."""
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
class TransportDesc:
    """One backend an engine has open, as a peer needs it to decide whether it reaches this engine.

    ``scope`` says where the backend reaches: for cma the host and namespaces
    (boot id, pid and net namespace, uid), which must equal the peer's own; empty
    where any peer with the same backend may use it (tcp, verbs).
    """

    name: str
    scope: str = ""


def _transports(data: dict[str, Any]) -> tuple[TransportDesc, ...]:
    raw = data.get("transports", [])
    if not isinstance(raw, list) or len(raw) > MAX_TRANSPORTS:
        raise InvalidArgument(f"descriptor field 'transports' must be a list of at most {MAX_TRANSPORTS}")
    out = []
    for item in raw:
        if not isinstance(item, dict):
            raise InvalidArgument("descriptor field 'transports' holds a non-object")
        out.append(TransportDesc(_field(item, "name", str), _field(item, "scope", str)))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class EngineDesc:
    """An engine as its peers see it. ``incarnation`` changes at every engine start.

    ``backend`` is the engine's preferred backend; ``transports`` every one it has
    open, in its order of preference (empty from an engine older than transports:
    then ``backend`` is its only one).
    """

    key: str
    host: str
    port: int
    incarnation: int
    backend: str
    transports: tuple[TransportDesc, ...] = ()

    def transport_names(self) -> tuple[str, ...]:
        """The backends a session to this engine may use, best first."""
        return tuple(t.name for t in self.transports) or (self.backend,)

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
            transports=_transports(data),
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
    rkeys: tuple[tuple[str, int], ...] = ()
    """With several backends open: the region's rkey on each, by backend name (``rkey`` is the first's)."""

    def rkey_for(self, transport: str) -> int:
        """The rkey a request over ``transport`` names (``rkey`` when the owner has one backend)."""
        for name, rkey in self.rkeys:
            if name == transport:
                return rkey
        return self.rkey

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["access"] = int(self.access)
        if self.rkeys:
            data["rkeys"] = dict(self.rkeys)
        else:
            del data["rkeys"]
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
            rkeys=_rkeys(data),
        )
        rkeys = [desc.rkey, *(r for _, r in desc.rkeys)]
        if not (0 <= desc.addr <= _U64 and 0 < desc.length <= _U64 and all(0 <= r < 1 << 32 for r in rkeys)):
            raise InvalidArgument("MemoryDesc has an out-of-range addr, length or rkey")
        return desc

    @classmethod
    def unpack(cls, raw: bytes | str) -> MemoryDesc:
        return cls.from_dict(_load(raw, "MemoryDesc"))


def _rkeys(data: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    raw = data.get("rkeys", {})
    if not isinstance(raw, dict) or len(raw) > MAX_TRANSPORTS:
        raise InvalidArgument(f"descriptor field 'rkeys' must map at most {MAX_TRANSPORTS} backends to rkeys")
    if not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in raw.items()):
        raise InvalidArgument("descriptor field 'rkeys' must map backend names to ints")
    return tuple(raw.items())
