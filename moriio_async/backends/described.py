"""What a backend says of itself (``Backend.describe()``, ``IOEngine.describe_backend()``): typed and frozen.

One ``msgspec.Struct`` per backend, each a ``BackendFacts`` (``backend`` names
it), so a caller reads ``facts.data_port`` after narrowing with ``isinstance``,
and a log line or ``doctor`` turns one into JSON with ``msgspec.json.encode``
(or ``msgspec.to_builtins`` for plain objects). The structs live here, apart
from the backends, so naming one imports no optional dependency (pyverbs).
"""

from __future__ import annotations

import msgspec

from ..core.faultplan import Applied

__all__ = [
    "BackendFacts",
    "CmaFacts",
    "DataPlaneCounts",
    "FaultPlanFacts",
    "MockFacts",
    "TcpFacts",
    "VerbsFacts",
]


class BackendFacts(msgspec.Struct, frozen=True, kw_only=True):
    """Facts for logs and ``doctor`` common to every backend."""

    backend: str
    """The backend's name: "tcp", "cma", "mock" or "verbs"."""
    max_sge: int
    """Scatter/gather entries a request may carry."""


class DataPlaneCounts(msgspec.Struct, frozen=True, kw_only=True):
    """What peers did wrong on a software target's own data port (``backends/tcp/guard.py``)."""

    refused_tokens: int
    bad_messages: int
    slow_messages: int
    refused_connections: int
    access_errors: int
    aborted_requests: int
    suppressed_log_lines: int
    evicted_hellos: int
    lockouts: int
    delayed: int


class TcpFacts(BackendFacts, frozen=True, kw_only=True):
    host: str
    data_port: int
    wire_version: int
    sq_depth: int
    retry_timeout: float
    threads: str
    """Which threads the backend runs, in words."""
    data_plane: DataPlaneCounts


class CmaFacts(BackendFacts, frozen=True, kw_only=True):
    socket: str
    """The abstract Unix socket peers dial ("@" + its name)."""
    pid: int
    boot_id: str
    wire_version: int
    yama_ptrace_scope: int | None
    cap_sys_ptrace: bool
    ptracer: str
    sq_depth: int
    round_bytes: int
    threads: int
    split_bytes: int


class MockFacts(BackendFacts, frozen=True, kw_only=True):
    hold: bool
    silent_cq: bool
    sq_depth: int


class FaultPlanFacts(msgspec.Struct, frozen=True, kw_only=True):
    """A verbs backend's fault plan: its rules in words and the faults that fired so far."""

    rules: tuple[str, ...]
    applied: tuple[Applied, ...]


class VerbsFacts(BackendFacts, frozen=True, kw_only=True):
    pyverbs: str
    completion_channel_fd: bool
    device: str
    port: int
    port_state: str
    mtu: int
    gid_index: int
    gid: str
    gid_type: str | None
    gid_reason: str
    max_qp_wr: int
    max_cqe: int
    max_qp_rd_atom: int
    async_events: bool
    fault_plan: FaultPlanFacts | None = None
