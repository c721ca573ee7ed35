"""Control-plane frames: a 4-byte big-endian length, then one JSON object.

Every frame has a size limit checked before the body is read, so a peer
cannot make the listener allocate more than ``max_frame`` bytes, and a body
must be an object with a string ``op``. Anything else is a ``FrameError``;
the connection that sent it gets an error reply and is closed.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from ..errors import ControlPlaneError

__all__ = ["HEADER", "FrameError", "decode_body", "encode_frame", "parse_header"]

HEADER = struct.Struct("!I")
DEFAULT_MAX_FRAME = 1 << 20


class FrameError(ControlPlaneError):
    """A malformed or oversized control frame."""


def encode_frame(message: dict[str, Any], max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > max_frame:
        raise FrameError(f"control message of {len(body)} bytes exceeds the {max_frame}-byte frame limit")
    return HEADER.pack(len(body)) + body


def parse_header(header: bytes, max_frame: int = DEFAULT_MAX_FRAME) -> int:
    (length,) = HEADER.unpack(header)
    if length == 0 or length > max_frame:
        raise FrameError(f"frame length {length} outside 1..{max_frame}")
    return int(length)


def decode_body(body: bytes) -> dict[str, Any]:
    try:
        message = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FrameError(f"frame is not JSON: {exc}") from None
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise FrameError("frame is not an object with a string 'op'")
    return message
