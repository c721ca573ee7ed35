"""``IOEngineConfig``: every knob in one frozen dataclass, with MoRI-IO/vLLM names where they exist."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..backends.base import BackendOptions
from ..backends.options import CmaOptions, MockOptions, TcpOptions, VerbsOptions
from ..core.auth import load_secret
from ..core.faultplan import FaultPlan
from ..core.protocol import MAX_KEY
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
    """"tcp", "verbs", "cma" (peers on this host), "mock": that backend alone; or "auto": every one of cma,
    verbs and tcp this host can open, each session using the best one its peer shares (cma on the same
    host, then verbs, then tcp)."""
    backends: tuple[str, ...] = ()
    """Several backends in this order of preference (overrides ``backend``); each must open."""
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
    """How long ``Session.abort`` waits for flush completions before declaring them, and ``close``
    for each backend to close (one that takes longer is logged and left to finish in its thread)."""
    tcp: TcpOptions = field(default_factory=TcpOptions)
    """The tcp backend's own settings: its data port's hello bounds, fault injection."""
    verbs: VerbsOptions = field(default_factory=VerbsOptions)
    """The verbs backend's own settings: device, port, GID, retries, fault injection."""
    cma: CmaOptions = field(default_factory=CmaOptions)
    """The cma backend's own settings: copy windows and threads, ptracer policy, revoke wait."""
    mock: MockOptions = field(default_factory=MockOptions)
    """The mock backend's own settings: a held NIC, silent completion queues, its fabric."""
    backend_extra: Mapping[str, Any] = field(default_factory=dict)
    """Deprecated: the untyped form of those (``{"fault_plan": plan}``, ``{"hold": True}``, ...); each key
    is moved into the options that have a field of its name (a DeprecationWarning says so)."""

    # -- trust and bounds: what peers must prove, and what they can make this engine hold --------
    secret: bytes | str | None = field(default=None, repr=False)
    """Shared secret peers must prove in the hello (at least 16 bytes); None reads ``$MORIIO_ASYNC_SECRET``,
    and ``""`` turns authentication off even when that variable is set. Never sent, never printed."""
    max_links: int = 4096
    """Control links accepted at once, in all. At the cap, a new connection closes one still in its hello, else
    the link idle the longest (hello said, carrying nothing, idle for half ``hello_timeout``: its peer dials
    again when it needs it); if there is neither, it is refused at accept."""
    max_links_per_address: int = 1024
    """Control links accepted at once from one remote address (the same: one in its hello from there makes
    room, else a refusal). High enough for a host running many engines (a worker per GPU, containers behind one
    NAT address, a single-machine fleet): lower it where every peer has an address of its own."""
    hello_timeout: float = 5.0
    """Seconds an accepted connection (control or TCP data port) has to complete its hello, proof included,
    from the accept (at most ``control_timeout``); then it is closed."""
    max_hellos: int = 128
    """Accepted control connections in their hello (nothing proved yet) at once, below ``max_links`` (the
    rest is a reserve for links whose hello completed). One more closes the oldest one that has not sent a
    whole message (a silent one first: nothing had come by its accept, while an honest dialer sends its
    hello at once), else the oldest that has been in its hello for half ``hello_timeout``; only if every one
    is younger and has sent a whole message is the newcomer refused. So silent or trickling connections can
    neither fill ``max_links`` nor keep a legitimate peer out; counted in ``statistics().guard.evicted_hellos``."""
    max_hellos_per_address: int = 32
    """Of those, from one remote address: over it, the oldest from that address that had half its hello
    deadline makes room."""
    max_failures_per_source: int = 16
    """Failed guesses one source (a remote address; an IPv6 one by its /64) may make within
    ``failure_lockout``: failed proofs on the control port; unknown tokens and refused remote accesses on the
    TCP data port. Past it, each new connection from that source to that port waits a quarter of the hello
    deadline before it is heard, for ``failure_lockout`` seconds (a timer, never a sleep on the event loop):
    every further guess costs the guesser that long, while an honest peer behind the same address is only
    delayed, never refused (counted in ``statistics().guard.lockouts``, ``.guard.delayed`` and in the data-plane
    counters)."""
    failure_lockout: float = 30.0
    """Seconds over which failures are counted, and for which a source over its budget is delayed."""
    link_idle_timeout: float = 120.0
    """Seconds after which a link carrying nothing (no pair, no request under way) is closed; the next request
    dials again. A dialing engine closes its own idle links at half this, before the listener would."""
    max_key: int = MAX_KEY
    """Longest engine key a peer may say hello with (the protocol's ceiling is 1024)."""
    max_peers: int = 1024
    """Peers remembered once none of their links is open (least recently used forgotten first)."""
    max_notifications: int = 4096
    """Notifications queued for ``recv_notification``; when full, links stop reading (backpressure: the
    sender's ``notify`` fails after its ``control_timeout``)."""
    max_notification_bytes: int = 64 << 20
    """Bytes of notification data queued, with the same backpressure."""
    max_answering_qps_per_link: int = 256
    """Queue pairs a peer may have this engine answer over one link (its sessions); more are refused."""
    max_inbound_statuses: int = 4096
    """Target side: ended transfers kept per initiator for ``pop_inbound_transfer_status``; beyond it the
    oldest unpopped one is dropped (counted in ``statistics().inbound.dropped``). A forgotten peer's go
    with it."""
    max_inbound_status_bytes: int = 8 << 20
    """Target side: bytes all initiators' unpopped inbound statuses may take together (accounted: 320 an
    entry, about 700 an initiator); beyond it the oldest entry of any initiator is dropped (counted in
    ``statistics().inbound.dropped`` and ``.inbound.dropped_for_bytes``)."""

    def __post_init__(self) -> None:
        for name in (
            "transfer_timeout",
            "control_timeout",
            "retry_timeout",
            "abort_timeout",
            "link_idle_timeout",
            "hello_timeout",
            "failure_lockout",
        ):
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"IOEngineConfig.{name} must be > 0")
        for name in (
            "sq_depth",
            "max_sge",
            "max_wr_bytes",
            "max_frame",
            "max_links",
            "max_links_per_address",
            "max_key",
            "max_peers",
            "max_notifications",
            "max_notification_bytes",
            "max_answering_qps_per_link",
            "max_inbound_statuses",
            "max_inbound_status_bytes",
            "max_hellos",
            "max_hellos_per_address",
            "max_failures_per_source",
        ):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"IOEngineConfig.{name} must be >= 1")
        if isinstance(self.backends, str) or not all(isinstance(b, str) for b in self.backends):
            raise InvalidArgument("IOEngineConfig.backends must be a sequence of backend names")
        object.__setattr__(self, "backends", tuple(self.backends))  # frozen: a list given is kept as a tuple
        known = {"tcp", "verbs", "cma", "mock"}
        if len(set(self.backends)) != len(self.backends) or not set(self.backends) <= known:
            raise InvalidArgument(f"IOEngineConfig.backends must name distinct backends of {sorted(known)}")
        if not 0 <= self.port <= 0xFFFF:
            raise InvalidArgument("IOEngineConfig.port must be within 0..65535")
        if self.max_key > MAX_KEY:
            raise InvalidArgument(f"IOEngineConfig.max_key may not exceed the protocol's {MAX_KEY}")
        if self.secret is not None and not isinstance(self.secret, bytes | str):
            raise InvalidArgument(f"IOEngineConfig.secret must be bytes or str, not {type(self.secret).__name__}")
        if self.secret:
            load_secret(self.secret)  # too short: refused now, not at the first hello
        for name, kind in _SPECIFIC.items():
            if not isinstance(getattr(self, name), kind):
                raise InvalidArgument(f"IOEngineConfig.{name} must be a {kind.__name__}, not {getattr(self, name)!r}")
        if self.backend_extra:
            self._take_backend_extra()

    def _take_backend_extra(self) -> None:
        """Move the deprecated ``backend_extra`` keys into the typed options (frozen: set once, here)."""
        warnings.warn(
            "IOEngineConfig(backend_extra=...) is deprecated: use tcp=TcpOptions(...), verbs=VerbsOptions(...), "
            "cma=CmaOptions(...) or mock=MockOptions(...)",
            DeprecationWarning,
            stacklevel=4,  # the caller's IOEngineConfig(...): past __post_init__ and the generated __init__
        )
        extra = dict(self.backend_extra)
        for key, new in _RENAMED.items():
            if key in extra:
                extra[new] = extra.pop(key)
        unknown = set(extra)
        for name, kind in _SPECIFIC.items():
            fields = {f.name for f in dataclasses.fields(kind)} & set(extra)
            if name == "tcp" and not isinstance(extra.get("fault_plan", FaultPlan()), FaultPlan):
                fields.discard("fault_plan")  # a plan's dict or JSON: only verbs took those
            unknown -= fields
            if fields:
                object.__setattr__(self, name, replace(getattr(self, name), **{f: extra[f] for f in fields}))
        if unknown:
            raise InvalidArgument(f"IOEngineConfig.backend_extra: no backend has the settings {sorted(unknown)}")

    def resolved_secret(self) -> bytes | None:
        """The secret in force: ``secret``, else ``$MORIIO_ASYNC_SECRET``; None when authentication is off."""
        if self.secret is not None and len(self.secret) == 0:
            return None
        return load_secret(self.secret)

    def transport_names(self) -> tuple[str, ...]:
        """The backends to open, best first."""
        if self.backends:
            return self.backends
        return ("cma", "verbs", "tcp") if self.backend == "auto" else (self.backend,)

    def backend_options(self, name: str, tag: int = 0) -> BackendOptions:
        """What backend ``name`` opens with, as the engine's ``tag``-th transport: the settings every backend
        may read, and its own options."""
        return BackendOptions(
            host=self.host,
            sq_depth=self.sq_depth,
            max_sge=self.max_sge,
            retry_timeout=self.retry_timeout,
            connect_timeout=self.control_timeout,
            hello_timeout=self.hello_timeout,
            max_failures_per_source=self.max_failures_per_source,
            failure_lockout=self.failure_lockout,
            qp_tag=tag,
            specific=getattr(self, name),
        )


_SPECIFIC: dict[str, type] = {"tcp": TcpOptions, "verbs": VerbsOptions, "cma": CmaOptions, "mock": MockOptions}
"""Each backend's name, which is also the field of its options."""
_RENAMED = {"verbs_flush_grace": "flush_grace", "verbs_extended_qp": "extended_qp"}
"""``backend_extra`` keys whose option field is named otherwise."""
