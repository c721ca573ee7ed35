"""Control-plane frames: a 4-byte big-endian length, then the body (one message, see ``protocol``).

Every frame has a size limit checked before the body is read, so a peer
cannot make the listener allocate more than ``max_frame`` bytes. A length
outside ``1..max_frame`` is a ``FrameError``; the connection that sent it gets
an error reply and is closed.
"""

from __future__ import annotations

import struct

from ..errors import ControlPlaneError

__all__ = ["DEFAULT_MAX_FRAME", "HEADER", "FrameError", "frame", "parse_header"]

HEADER = struct.Struct("!I")
DEFAULT_MAX_FRAME = 1 << 20


class FrameError(ControlPlaneError):
    """A malformed or oversized control frame."""


def frame(body: bytes, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    """``body`` behind its length header; ``FrameError`` if it exceeds ``max_frame``."""
    if len(body) > max_frame:
        raise FrameError(f"control message of {len(body)} bytes exceeds the {max_frame}-byte frame limit")
    return HEADER.pack(len(body)) + body


def parse_header(header: bytes, max_frame: int = DEFAULT_MAX_FRAME) -> int:
    """The body length a header announces; ``FrameError`` outside ``1..max_frame``."""
    (length,) = HEADER.unpack(header)
    if length == 0 or length > max_frame:
        raise FrameError(f"frame length {length} outside 1..{max_frame}")
    return int(length)
