"""``IOEngineConfig``: every knob in one frozen dataclass, with MoRI-IO/vLLM names where they exist."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..backends.base import BackendOptions
from ..errors import InvalidArgument

__all__ = ["IOEngineConfig"]


@dataclass(frozen=True, slots=True)
class IOEngineConfig:
    """How an engine listens, which backend it opens, and its deadlines."""

    host: str = "127.0.0.1"
    """Address of the control plane (and of the TCP backend's data plane)."""
    port: int = 0
    """Control-plane port; 0 picks a free one (see ``IOEngine.address``)."""
    backend: str = "tcp"
    """"tcp", "verbs", or "auto" (verbs when a device works, else tcp)."""
    transfer_timeout: float = 30.0
    """Default deadline of ``waiting_for_transfer_complete`` (vLLM's transfer_timeout)."""
    control_timeout: float = 10.0
    """Deadline of every control-plane read and request."""
    max_frame: int = 1 << 20
    """Largest control frame accepted, in bytes."""
    sq_depth: int = 256
    """Send-queue depth per queue pair (clipped to the device's limit)."""
    max_sge: int = 16
    max_wr_bytes: int = 64 << 20
    """Largest single work request; bigger merged segments are split."""
    retry_timeout: float = 5.0
    """Silence after which an outstanding request fails with RETRY_EXC_ERR (TCP backend)."""
    abort_timeout: float = 10.0
    """How long ``Session.abort`` waits for flush completions before declaring them."""
    device: str | None = None
    ib_port: int = 1
    gid_index: int | None = None
    qp_timeout: int = 14
    retry_cnt: int = 6
    """Verbs: transport retries (at most 6: rxe treats 7 as retry forever)."""
    rnr_retry: int = 7
    backend_extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("transfer_timeout", "control_timeout", "retry_timeout", "abort_timeout"):
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"IOEngineConfig.{name} must be > 0")
        for name in ("sq_depth", "max_sge", "max_wr_bytes", "max_frame"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"IOEngineConfig.{name} must be >= 1")
        if not 0 <= self.port <= 0xFFFF:
            raise InvalidArgument("IOEngineConfig.port must be within 0..65535")

    def backend_options(self) -> BackendOptions:
        return BackendOptions(
            host=self.host,
            sq_depth=self.sq_depth,
            max_sge=self.max_sge,
            retry_timeout=self.retry_timeout,
            connect_timeout=self.control_timeout,
            device=self.device,
            ib_port=self.ib_port,
            gid_index=self.gid_index,
            qp_timeout=self.qp_timeout,
            retry_cnt=self.retry_cnt,
            rnr_retry=self.rnr_retry,
            extra=self.backend_extra,
        )
