"""The control-plane messages: typed, validated and bounded, one JSON object per frame.

Each message is a frozen ``msgspec`` Struct tagged by its ``op`` field, so
decoding a frame checks every field's type and range in one pass, with no
``dict`` in between. Three kinds:

- requests (``hello``, ``proof``, ``connect_qp``, ``memory``) carry an ``id``
  and get exactly one reply;
- replies (``challenge``, ``welcome``, ``qp``, ``exports``, ``error``) carry
  the request's id as ``re``; an ``error`` without ``re`` answers a bad frame
  (or a connection refused at accept), and the link is closed after it;
- notices (``close_qp``, ``notify``, ``done``) carry neither and get no answer.

The hello, with a shared secret (``core.auth``): the dialer's ``hello``
says ``auth`` and carries its nonce; the listener answers ``challenge`` (its
engine, its nonce and its proof, and no memory); the dialer checks that proof
and sends ``proof``; only then does the listener answer ``welcome`` with the
memory it exports. Without a secret, ``hello`` is answered by ``welcome``.
A side with a secret refuses a side without one (``error``, reason ``auth``).

A frame that is not one of these messages (bad JSON, a wrong type, an
unknown op, a value out of range, nesting deeper than the decoder allows) is
a ``FrameError``. Fields a message does not declare are ignored, so a newer
peer may add some. Strings, lists and endpoints have ceilings of their own,
on top of the frame size limit. The engine and the regions travel as the
descriptors themselves (``moriio_async.descriptors``), which declare theirs.
"""

from __future__ import annotations

from typing import Annotated, TypeVar

import msgspec

from ..descriptors import MAX_KEY, U32, U64, EngineDesc, MemoryDesc, Short, check_u64
from .framing import DEFAULT_MAX_FRAME, FrameError, frame

__all__ = [
    "MAX_KEY",
    "MAX_REGIONS",
    "Challenge",
    "CloseQp",
    "ConnectQp",
    "Done",
    "Exports",
    "Hello",
    "ListMemory",
    "Message",
    "Notice",
    "Notify",
    "Proof",
    "QpReady",
    "Refused",
    "Reply",
    "Request",
    "Welcome",
    "answering",
    "decode",
    "encode",
    "proven_transports",
    "with_id",
]

MAX_REGIONS = 1 << 16
"""Most regions one ``welcome`` or ``exports`` may list."""

Text = Annotated[str, msgspec.Meta(max_length=4096)]
Digest = Annotated[bytes, msgspec.Meta(max_length=64)]
"""A nonce or an HMAC (base64 on the wire); ``core.auth`` checks the exact length."""

Endpoint = Annotated[
    dict[Annotated[str, msgspec.Meta(max_length=64)], Short | int | bool],
    msgspec.Meta(max_length=32),
]
"""A backend's queue-pair endpoint: a flat map of scalars (see ``backends.base.QueuePair.endpoint``)."""


class _Message(msgspec.Struct, frozen=True, tag_field="op"):
    """Base of every message; subclasses name their ``op`` with ``tag=`` and are built by keyword."""


def proven_transports(dialer: EngineDesc, listener: EngineDesc) -> bytes:
    """What the authenticated hello's proofs say about transports (``core.auth.Transcript.transports``):
    both ends' lists as each sent them, canonically encoded; empty when neither sent any (an older peer)."""
    if not dialer.transports and not listener.transports:
        return b""
    return _encoder.encode(dialer.transports) + b"\n" + _encoder.encode(listener.transports)


Regions = Annotated[list[MemoryDesc], msgspec.Meta(max_length=MAX_REGIONS)]

# -- requests --------------------------------------------------------------------------------------


class Hello(_Message, frozen=True, kw_only=True, tag="hello"):
    """The first frame on every link, from the side that dialed: who it is, and whether it authenticates."""

    id: int = 0
    engine: EngineDesc
    auth: bool = False
    """The dialer holds a shared secret: it expects a ``challenge`` and will send a ``proof``."""
    nonce: Digest = b""
    """The dialer's fresh nonce (with ``auth``)."""


class Proof(_Message, frozen=True, kw_only=True, tag="proof"):
    """The dialer's proof of the shared secret, once it checked the listener's ``challenge``."""

    id: int = 0
    proof: Digest


class ConnectQp(_Message, frozen=True, kw_only=True, tag="connect_qp"):
    """Open an answering queue pair for a session, against the asker's endpoint."""

    id: int = 0
    incarnation: U64
    """The incarnation the asker's remote descriptors belong to: a restarted engine refuses."""
    endpoint: Endpoint
    transport: Annotated[str, msgspec.Meta(max_length=16)] = ""
    """The backend to open the answering pair on (one the target advertised); empty: its preferred one."""

    def __post_init__(self) -> None:
        check_u64(incarnation=self.incarnation)


class ListMemory(_Message, frozen=True, kw_only=True, tag="memory"):
    """Ask for the regions the engine exports by name."""

    id: int = 0


# -- replies ---------------------------------------------------------------------------------------


class Challenge(_Message, frozen=True, kw_only=True, tag="challenge"):
    """The answer to an authenticating ``hello``: the listener, its nonce and its proof; no memory yet."""

    re: int = 0
    engine: EngineDesc
    nonce: Digest
    proof: Digest


class Welcome(_Message, frozen=True, kw_only=True, tag="welcome"):
    """The answer to ``hello``: the listening engine and what it exports."""

    re: int = 0
    engine: EngineDesc
    memory: Regions = []


class QpReady(_Message, frozen=True, kw_only=True, tag="qp"):
    """The answering queue pair is connected; ``qp`` names it in a later ``close_qp``."""

    re: int = 0
    qp: U32
    endpoint: Endpoint


class Exports(_Message, frozen=True, kw_only=True, tag="exports"):
    re: int = 0
    memory: Regions = []


class Refused(_Message, frozen=True, kw_only=True, tag="error"):
    """A request was refused (``re`` set), or a frame was bad (``re`` None, and the link closes)."""

    re: int | None = None
    reason: Annotated[str, msgspec.Meta(max_length=32)]
    """``handshake``, ``auth``, ``busy``, ``frame``, ``stale``, ``closed``, ``refused`` or ``internal``."""
    message: Text = ""


# -- notices ---------------------------------------------------------------------------------------


class CloseQp(_Message, frozen=True, kw_only=True, tag="close_qp"):
    """The session behind the answering queue pair ``qp`` is gone: close that pair."""

    qp: U32


class Notify(_Message, frozen=True, kw_only=True, tag="notify"):
    """A small message for the application (``IOEngine.notify``); bytes travel as base64."""

    data: bytes


class Done(_Message, frozen=True, kw_only=True, tag="done"):
    """The sender's transfer ``uid`` (one it was given a uid for) ended with status ``code``.

    Sent once the transfer ended at the initiator, so after its data (for a
    write: placed in the target's memory). The target files it per sender for
    ``IOEngine.pop_inbound_transfer_status``.
    """

    uid: U64
    code: Annotated[int, msgspec.Meta(ge=0, le=255)]
    """A ``StatusCode``: SUCCESS (0) or an error (> 10)."""

    def __post_init__(self) -> None:
        check_u64(uid=self.uid)


Request = Hello | Proof | ConnectQp | ListMemory
Reply = Challenge | Welcome | QpReady | Exports | Refused
Notice = CloseQp | Notify | Done
Message = Request | Reply | Notice

M = TypeVar("M", bound=_Message)

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Message)


def encode(message: Message, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    """One framed message; ``FrameError`` if it exceeds ``max_frame``."""
    return frame(_encoder.encode(message), max_frame)


def decode(body: bytes) -> Message:
    """The message in a frame's body; ``FrameError`` for anything that is not exactly one."""
    try:
        return _decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise FrameError(f"invalid control message: {exc}") from None
    except msgspec.DecodeError as exc:
        raise FrameError(f"frame is not a JSON message: {exc}") from None
    except RecursionError:
        # msgspec skips fields it does not know recursively: deep nesting there ends here, not in a crash.
        raise FrameError("control message nested too deeply") from None
    except (ValueError, OverflowError) as exc:  # defensive: nothing else a decoder may raise on bad input
        raise FrameError(f"invalid control message: {exc}") from None


def with_id(message: M, request_id: int) -> M:
    """``message`` (a request) numbered ``request_id``."""
    return msgspec.structs.replace(message, id=request_id)


def answering(message: M, request_id: int) -> M:
    """``message`` (a reply) answering request ``request_id``."""
    return msgspec.structs.replace(message, re=request_id)
