"""Descriptors that travel between engines: who an engine is, and what memory it exports.

Each is a frozen ``msgspec`` Struct that declares its wire bounds (lengths,
counts, ranges), defined once: the control messages (``core.protocol``) embed
these Structs as they are, and ``pack()``/``unpack()`` give and take bytes to
hand a peer by any means (MoRI-IO's explicit style). Decoding checks every
field in one pass, since the bytes came from elsewhere, and a peer cannot make
this side allocate past the bounds. Building one in Python checks only what
``__post_init__`` says (the ranges msgspec cannot express), as a dataclass would.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Annotated, ClassVar, Self

import msgspec

from .errors import InvalidArgument
from .status import Access

__all__ = [
    "MAX_KEY",
    "MAX_TRANSPORTS",
    "U16",
    "U32",
    "U64",
    "U64_MAX",
    "BackendName",
    "Descriptor",
    "EngineDesc",
    "Key",
    "MemoryDesc",
    "Name",
    "Short",
    "TransportDesc",
    "check_u64",
    "new_incarnation",
]

MAX_KEY = 1024
"""Longest engine key or region name, in characters."""
MAX_TRANSPORTS = 4
"""Most transports an engine advertises (one per backend kind)."""
U64_MAX = (1 << 64) - 1

Key = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_KEY)]
Name = Annotated[str, msgspec.Meta(max_length=MAX_KEY)]
Short = Annotated[str, msgspec.Meta(max_length=255)]
BackendName = Annotated[str, msgspec.Meta(min_length=1, max_length=16)]
U16 = Annotated[int, msgspec.Meta(ge=0, le=0xFFFF)]
U32 = Annotated[int, msgspec.Meta(ge=0, le=0xFFFF_FFFF)]
U64 = Annotated[int, msgspec.Meta(ge=0)]
"""At most ``U64_MAX``: the owner checks it with ``check_u64``, since msgspec bounds integers only within int64."""

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


def check_u64(**fields: int) -> None:
    """``InvalidArgument`` naming the first field above ``U64_MAX`` (a ``__post_init__`` helper:
    decoding reports it as a validation error at the Struct's path)."""
    for name, value in fields.items():
        if value > U64_MAX:
            raise InvalidArgument(f"`{name}` exceeds 2**64 - 1")


class _Kind(msgspec.Struct, frozen=True):
    kind: str = ""


_encoder = msgspec.json.Encoder()
_kind_decoder = msgspec.json.Decoder(_Kind)
_decoders: dict[type, msgspec.json.Decoder[object]] = {}


class Descriptor(msgspec.Struct, frozen=True):
    """A Struct that also travels on its own: ``pack()`` tags it with its ``KIND``; ``unpack()`` checks that tag."""

    KIND: ClassVar[str]

    def pack(self) -> bytes:
        # The tag is added here, not declared on the Struct: embedded in a control message, a
        # descriptor's encoding stays what peers already decode.
        return _encoder.encode({"kind": self.KIND, **msgspec.structs.asdict(self)})

    @classmethod
    def unpack(cls, raw: bytes | str) -> Self:
        """The descriptor ``pack()`` gave; ``InvalidArgument`` (naming the field) for anything else."""
        decoder = _decoders.get(cls) or _decoders.setdefault(cls, msgspec.json.Decoder(cls))
        try:
            if _kind_decoder.decode(raw).kind != cls.KIND:
                raise InvalidArgument(f"cannot unpack {cls.__name__}: not a packed {cls.__name__}")
            desc = decoder.decode(raw)
        except msgspec.DecodeError as exc:  # a ValidationError too: its message names the field
            raise InvalidArgument(f"cannot unpack {cls.__name__}: {exc}") from None
        except RecursionError:  # msgspec skips unknown fields recursively
            raise InvalidArgument(f"cannot unpack {cls.__name__}: nested too deeply") from None
        assert isinstance(desc, cls)
        return desc


class TransportDesc(msgspec.Struct, frozen=True):
    """One backend an engine has open, as a peer needs it to decide whether it reaches this engine.

    ``scope`` says where the backend reaches: for cma the host and namespaces
    (boot id, pid and net namespace, uid), which must equal the peer's own; empty
    where any peer with the same backend may use it (tcp, verbs).
    """

    name: BackendName
    scope: Short = ""


class EngineDesc(Descriptor, frozen=True):
    """An engine as its peers see it. ``incarnation`` changes at every engine start.

    ``backend`` is the engine's preferred backend; ``transports`` every one it has
    open, in its order of preference (empty from an engine older than transports:
    then ``backend`` is its only one).
    """

    KIND = "EngineDesc"

    key: Key
    host: Short
    port: U16
    incarnation: U64
    backend: Short
    transports: Annotated[tuple[TransportDesc, ...], msgspec.Meta(max_length=MAX_TRANSPORTS)] = ()

    def __post_init__(self) -> None:
        check_u64(incarnation=self.incarnation)

    def transport_names(self) -> tuple[str, ...]:
        """The backends a session to this engine may use, best first."""
        return tuple(t.name for t in self.transports) or (self.backend,)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


Rkeys = Annotated[dict[BackendName, U32], msgspec.Meta(max_length=MAX_TRANSPORTS)]
"""A region's rkey on each backend, by backend name."""


class MemoryDesc(Descriptor, frozen=True):
    """A registered region: enough for a peer to target it with one-sided operations.

    ``addr`` is the region's address in its owner's process, as with verbs, so
    a remote offset becomes ``addr + offset`` on the wire. ``access`` bits a peer
    sends beyond the known ones are dropped.
    """

    KIND = "MemoryDesc"

    engine_key: Key
    incarnation: U64
    name: Name
    addr: U64
    length: Annotated[int, msgspec.Meta(ge=1)]
    rkey: U32
    if TYPE_CHECKING:
        access: Access
    else:
        access: U32  # an int on the wire, bounded before it becomes an Access (Access(-1) is every bit)
    rkeys: Rkeys = {}
    """With several backends open: the region's rkey on each, by backend name (``rkey`` is the first's).
    Given as ``(name, rkey)`` pairs, it is kept as this mapping; do not change it in place."""

    def __post_init__(self) -> None:
        check_u64(incarnation=self.incarnation, addr=self.addr, length=self.length)
        msgspec.structs.force_setattr(self, "access", Access(int(self.access) & int(Access.all())))
        if not isinstance(self.rkeys, dict):  # (name, rkey) pairs, as before descriptors were Structs
            pairs: Iterable[tuple[str, int]] = self.rkeys
            msgspec.structs.force_setattr(self, "rkeys", dict(pairs))

    def __hash__(self) -> int:
        # The Struct's own hash would hash the rkeys dict; regions are looked up by descriptor.
        return hash((*msgspec.structs.astuple(self)[:-1], frozenset(self.rkeys.items())))

    def rkey_for(self, transport: str) -> int:
        """The rkey a request over ``transport`` names (``rkey`` when the owner has one backend)."""
        return self.rkeys.get(transport, self.rkey)
