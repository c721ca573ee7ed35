"""The lines ``moriio-async faults`` prints with ``--json``, and its two processes send it: one JSON object
a line, told apart by ``event``.

Each kind is a frozen ``msgspec.Struct`` tagged by ``event``, so the parent
reads a child's line back into the one it was (``decode``), a malformed line
fails there instead of as a missing key later, and a reader of the
``--json`` output finds every field named here.
"""

from __future__ import annotations

import msgspec

from ..core.faultplan import Applied

__all__ = [
    "ChildEvent",
    "Event",
    "Faults",
    "Ready",
    "Summary",
    "Target",
    "TargetEnd",
    "TransferLine",
    "decode",
    "encode",
]


class Event(msgspec.Struct, frozen=True, tag_field="event"):
    """One line of output."""


class Ready(Event, frozen=True, tag="ready"):
    """The target process listens (its first line)."""

    address: str
    pid: int


class Target(Event, frozen=True, tag="target"):
    """The parent's echo of ``Ready``: which target process the run uses."""

    address: str
    pid: int


class TransferLine(Event, frozen=True, tag="transfer"):
    """One transfer's outcome as the wait left it."""

    index: int
    op: str
    bytes: int
    outcome: str
    """SUCCESS, TIMEOUT, or the failure's ibv_wc_status name."""
    listed: str | None
    """Where the TransferError listed it: "failed", "timed_out" or None."""
    data_ok: bool | None
    """A READ that succeeded: whether its bytes are the target's (None for the rest)."""


class Faults(Event, frozen=True, tag="faults"):
    """The faults that fired on one side."""

    side: str
    applied: tuple[Applied, ...]


class Summary(Event, frozen=True, tag="summary"):
    """How the batch ended: transfers per outcome, and how long the wait took against its deadline."""

    transfers: int
    outcomes: dict[str, int]
    elapsed: float
    timeout: float
    deadline_reached: bool


class TargetEnd(Event, frozen=True, tag="target_end"):
    """How the target process ended (-9: killed by the plan)."""

    returncode: int


ChildEvent = Ready | TransferLine | Faults | Summary
"""What a child process prints."""

_decoder = msgspec.json.Decoder(ChildEvent)


def encode(event: Event) -> str:
    return msgspec.json.encode(event).decode()


def decode(line: str | bytes) -> ChildEvent:
    """A child's line (raises ``msgspec.ValidationError`` or ``msgspec.DecodeError`` for anything else)."""
    return _decoder.decode(line)
