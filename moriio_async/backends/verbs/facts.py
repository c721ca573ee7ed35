"""Plain facts about an RDMA device, with no pyverbs: what ``probe()`` and ``doctor`` report.

The numbers keep verbs' own encodings (``enum ibv_port_state``, ``enum ibv_mtu``,
``enum ibv_gid_type``) so a value here reads the same as in ``ibv_devinfo -v``.
"""

from __future__ import annotations

import ipaddress
import resource
from dataclasses import dataclass, field

__all__ = [
    "GID_TYPE_NAMES",
    "MTU_BYTES",
    "PORT_STATE_NAMES",
    "DeviceFacts",
    "DeviceLimits",
    "GidEntry",
    "PortFacts",
    "ProbeReport",
    "memlock_limit",
]

PORT_ACTIVE = 4
PORT_STATE_NAMES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
GID_TYPE_IB, GID_TYPE_ROCE_V1, GID_TYPE_ROCE_V2 = 0, 1, 2
GID_TYPE_NAMES = {GID_TYPE_IB: "IB", GID_TYPE_ROCE_V1: "RoCE v1", GID_TYPE_ROCE_V2: "RoCE v2"}
LINK_LAYER_INFINIBAND, LINK_LAYER_ETHERNET = 1, 2


@dataclass(frozen=True, slots=True)
class GidEntry:
    """One row of a port's GID table."""

    index: int
    """The row: what a path names as its source GID index."""
    gid: str
    """Eight colon-separated 16-bit groups, as pyverbs prints it."""
    gid_type: int
    """``enum ibv_gid_type`` (``type_name``: IB, RoCE v1, RoCE v2)."""
    ndev_ifindex: int = 0
    """The network interface the GID belongs to, by index (0: none)."""

    @property
    def type_name(self) -> str:
        return GID_TYPE_NAMES.get(self.gid_type, f"type {self.gid_type}")

    @property
    def ipv4(self) -> str | None:
        """The IPv4 address of an IPv4-mapped GID (``::ffff:a.b.c.d``), else None."""
        try:
            address = ipaddress.IPv6Address(self.gid)
        except ValueError:
            return None
        mapped = address.ipv4_mapped
        return None if mapped is None else str(mapped)

    @property
    def is_zero(self) -> bool:
        try:
            return int(ipaddress.IPv6Address(self.gid)) == 0
        except ValueError:
            return True


@dataclass(frozen=True, slots=True)
class DeviceLimits:
    """The device capabilities the backend clips its requests to."""

    max_qp_wr: int
    """Most outstanding work requests of one queue pair: the send-queue depth is clipped to it."""
    max_sge: int
    """Most scatter/gather entries of one work request."""
    max_cqe: int
    """Most entries of one completion queue."""
    max_qp_rd_atom: int
    """Most RDMA READs a queue pair answers at once, as the target."""
    max_qp_init_rd_atom: int
    """Most RDMA READs a queue pair has outstanding at once, as the initiator."""
    max_mr_size: int
    """Largest memory region one registration may cover, in bytes."""
    phys_port_cnt: int


@dataclass(frozen=True, slots=True)
class PortFacts:
    """One port: state, MTU and GID table."""

    port: int
    state: int
    active_mtu: int
    max_mtu: int
    link_layer: int
    lid: int
    gids: tuple[GidEntry, ...] = ()

    @property
    def active(self) -> bool:
        return self.state == PORT_ACTIVE

    @property
    def state_name(self) -> str:
        return PORT_STATE_NAMES.get(self.state, f"state {self.state}")

    @property
    def mtu_bytes(self) -> int:
        return MTU_BYTES.get(self.active_mtu, 0)


@dataclass(frozen=True, slots=True)
class DeviceFacts:
    """One RDMA device as ``probe()`` saw it; ``error`` is set when it could not be queried."""

    name: str
    limits: DeviceLimits | None = None
    ports: tuple[PortFacts, ...] = ()
    netdevs: tuple[str, ...] = ()
    error: str | None = None

    @property
    def active_ports(self) -> list[PortFacts]:
        return [p for p in self.ports if p.active]


@dataclass(frozen=True, slots=True)
class ProbeReport:
    """Everything ``probe()`` found: versions, devices, and why nothing works when nothing does."""

    pyverbs_version: str | None
    has_channel_fd: bool
    devices: tuple[DeviceFacts, ...] = ()
    error: str | None = None
    hint: str | None = None
    notes: tuple[str, ...] = field(default=())


def memlock_limit() -> int | None:
    """RLIMIT_MEMLOCK's soft limit in bytes, None when unlimited (registration pins pages against it)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft
