"""Typed messages between the proxy and the instances (HTTP) and between instances (notifications).

Engine notifications carry msgpack-encoded tagged structs with the names vLLM's
MoRIIO connector uses: ``remote_blocks`` (decode tells prefill where to write),
``write_done`` / ``write_failed`` (prefill's answer), ``release`` (decode lets
prefill free the blocks it read). The proxy talks to instances in JSON over
HTTP. Every decode is strict (``msgspec`` validates types), and every list a peer
sends is bounded by the receiver's own limits before it allocates anything.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from .kvpool import KVLayout

__all__ = [
    "AbortRequest",
    "ControlMessage",
    "EndpointInfo",
    "EngineRef",
    "ErrorBody",
    "GenerateRequest",
    "InstanceHealth",
    "KvTransfer",
    "PrefillRequest",
    "PrefillResponse",
    "ProxyHealth",
    "Release",
    "RemoteBlocks",
    "TokenLine",
    "TransferStats",
    "WriteDone",
    "WriteFailed",
    "control_decoder",
    "encode_control",
]

Mode = Literal["read", "write"]


class EngineRef(msgspec.Struct, frozen=True):
    """How to reach an instance's IOEngine: a restarted instance has a new ``incarnation``."""

    key: str
    address: str
    incarnation: int


class KvTransfer(msgspec.Struct, kw_only=True):
    """A completion's ``kv_transfer`` (the proxy adds it to the response): the attempts it took, the mode
    and instances of the one that served it, and what moving its KV cost (``TransferStats``, from the
    decode instance's ``x-kv-*`` headers). Mutable: the proxy fills it in as the request ends."""

    attempts: int = 1
    mode: str = ""
    prefill: str = ""
    decode: str = ""
    bytes: int = 0
    transfer_s: float = 0.0
    exposed_s: float | None = None
    """None until known: WRITE takes the prefill instance's (until write_done left), READ the decode's."""
    prefill_compute_s: float = 0.0
    """The prefill instance's compute time."""


class TransferStats(msgspec.Struct):
    """What moving one request's KV cost.

    ``transfer_s``: time with the request's KV on the wire (the union of its
    transfers' post-to-completion intervals). ``exposed_s``: the KV handoff's
    share of the path to the first token: READ, the reads (all layers posted at
    once); WRITE, from the end of prefill compute to write_done sent (the layers
    before the last overlap compute, so this is the last writes and the message).
    """

    bytes: int = 0
    transfer_s: float = 0.0
    exposed_s: float = 0.0
    compute_s: float = 0.0


# -- notifications between instances ------------------------------------------------------------


class RemoteBlocks(msgspec.Struct, tag="remote_blocks"):
    request_id: str
    block_ids: list[int]
    layout: KVLayout
    decode: EngineRef


class WriteDone(msgspec.Struct, tag="write_done"):
    request_id: str
    first_token: int
    stats: TransferStats
    num_writers: int = 1


class WriteFailed(msgspec.Struct, tag="write_failed"):
    request_id: str
    error: str


class Release(msgspec.Struct, tag="release"):
    request_id: str


ControlMessage = RemoteBlocks | WriteDone | WriteFailed | Release
_encoder = msgspec.msgpack.Encoder()


def encode_control(msg: ControlMessage) -> bytes:
    return _encoder.encode(msg)


def control_decoder() -> msgspec.msgpack.Decoder[ControlMessage]:
    return msgspec.msgpack.Decoder(ControlMessage)


# -- proxy -> instance HTTP bodies -------------------------------------------------------------


class PrefillRequest(msgspec.Struct):
    request_id: str
    prompt_token_ids: list[int]
    mode: Mode


class PrefillResponse(msgspec.Struct):
    request_id: str
    first_token: int
    stats: TransferStats
    engine: EngineRef
    block_ids: list[int] = []
    layout: KVLayout | None = None


class GenerateRequest(msgspec.Struct):
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    mode: Mode
    prefill: EngineRef
    first_token: int | None = None
    """READ mode: prefill's first token (WRITE mode: it comes with write_done)."""
    block_ids: list[int] = []
    layout: KVLayout | None = None


class TokenLine(msgspec.Struct, omit_defaults=True):
    """One line of decode's NDJSON stream: a token, or the end."""

    token: int | None = None
    finish_reason: str | None = None
    error: str | None = None


class AbortRequest(msgspec.Struct):
    """The proxy gave up on a request (its other leg failed)."""

    request_id: str


class ErrorBody(msgspec.Struct):
    """An instance's error answer; ``retryable`` tells the proxy another instance may succeed."""

    error: str
    retryable: bool = False
    cause: str = ""


class InstanceHealth(msgspec.Struct):
    role: str
    name: str
    pid: int
    model: str
    fingerprint: str
    engine: EngineRef
    backend: str
    layout: KVLayout
    blocks: dict[str, int]
    requests_in_flight: int
    requests_served: int


class EndpointInfo(msgspec.Struct, kw_only=True):
    """One instance as the proxy's ``/health`` lists it (the instance's own figures None until it answered)."""

    url: str
    role: str
    healthy: bool
    reason: str
    name: str | None
    pid: int | None
    incarnation: int | None
    in_flight: int
    served: int


class ProxyHealth(msgspec.Struct, kw_only=True):
    """The proxy's ``/health`` (503 until every role has a healthy instance)."""

    ready: bool
    mode: str
    instances: list[EndpointInfo]
