"""``CmaOptions``: what only the cma backend reads (``IOEngineConfig(cma=CmaOptions(...))``)."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import InvalidArgument
from ..base import check_number
from .permissions import POLICIES

__all__ = ["CmaOptions"]


@dataclass(frozen=True, slots=True)
class CmaOptions:
    """The cma backend's own settings: how its queue pairs move bytes, and the target's permissions."""

    round_bytes: int = 16 << 20
    """Bytes moved per window under the copy lock (a chunk of requests, or a piece of a huge one)."""
    threads: int = 1
    """Threads one window is split over (1: the worker alone)."""
    split_bytes: int = 1 << 20
    """Windows smaller than this are not split."""
    revoke_wait: float = 0.1
    """Seconds a deregistration waits at most for initiators to drop the region (then revoked anyway)."""
    ptracer: str = "peer"
    """Yama scope 1: "peer" names each initiator as this target's ptracer, "any" allows any same-uid
    process (logged once), "off" sets nothing."""
    quiet_refusal: bool = False
    """A refused attach is not logged by the backend (the engine, having a fallback, says it once)."""

    def __post_init__(self) -> None:
        check_number("CmaOptions", "round_bytes", self.round_bytes, 64 << 10, 1 << 30)
        check_number("CmaOptions", "threads", self.threads, 1, 64)
        check_number("CmaOptions", "split_bytes", self.split_bytes, 4 << 10, 1 << 30)
        if (
            not isinstance(self.revoke_wait, int | float)
            or isinstance(self.revoke_wait, bool)
            or not (0 < self.revoke_wait <= 60)
        ):
            raise InvalidArgument(f"CmaOptions.revoke_wait must be seconds in (0, 60], not {self.revoke_wait!r}")
        if self.ptracer not in POLICIES:
            raise InvalidArgument(f"CmaOptions.ptracer must be one of {POLICIES}, not {self.ptracer!r}")
        if not isinstance(self.quiet_refusal, bool):
            raise InvalidArgument(f"CmaOptions.quiet_refusal must be a bool, not {self.quiet_refusal!r}")
