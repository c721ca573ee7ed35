"""Which GID table entry a queue pair uses, and why.

RoCE ports list each address of their network device several times: a RoCE v1
and a RoCE v2 entry for the link-local IPv6 address, then for each IPv4
address an IPv4-mapped entry (``::ffff:a.b.c.d``) of each type. RoCE v2 is
routable UDP (port 4791) and what rxe and modern NICs speak by default, and the
IPv4-mapped entry is the one whose address a peer can reach; so that is the
default. An InfiniBand port has one entry that matters: index 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...errors import BackendUnavailable
from .facts import GID_TYPE_ROCE_V2, LINK_LAYER_INFINIBAND, GidEntry

__all__ = ["GidChoice", "choose_gid"]


@dataclass(frozen=True, slots=True)
class GidChoice:
    entry: GidEntry
    reason: str


def choose_gid(entries: Sequence[GidEntry], *, link_layer: int, requested: int | None, host: str | None) -> GidChoice:
    """Pick the GID entry: ``requested`` if given, else the RoCE v2 IPv4-mapped one (``host``'s if listed)."""
    usable = [e for e in entries if not e.is_zero]
    if requested is not None:
        for entry in usable:
            if entry.index == requested:
                return GidChoice(entry, f"gid_index={requested} was requested ({entry.type_name})")
        raise BackendUnavailable(
            f"GID index {requested} is empty or not in the port's table (indexes present: {[e.index for e in usable]})",
            hint="leave gid_index unset to pick the RoCE v2 IPv4 entry, or see `moriio-async doctor`",
        )
    if not usable:
        raise BackendUnavailable(
            "the port's GID table is empty",
            hint="give the RDMA device's network interface an IP address and bring it up",
        )
    if link_layer == LINK_LAYER_INFINIBAND:
        return GidChoice(usable[0], "InfiniBand port: the first GID (the port GID)")
    v2 = [e for e in usable if e.gid_type == GID_TYPE_ROCE_V2]
    v2_ipv4 = [e for e in v2 if e.ipv4 is not None]
    if host:
        for entry in v2_ipv4:
            if entry.ipv4 == host:
                return GidChoice(entry, f"RoCE v2 entry mapping host {host}")
    if v2_ipv4:
        why = f"first RoCE v2 IPv4-mapped entry ({v2_ipv4[0].ipv4})"
        if host and host not in ("127.0.0.1", "0.0.0.0", "localhost"):
            why += f"; host {host} has no GID on this port"
        return GidChoice(v2_ipv4[0], why)
    if v2:
        return GidChoice(v2[0], "no IPv4-mapped RoCE v2 entry: the first RoCE v2 entry (IPv6)")
    return GidChoice(usable[0], "no RoCE v2 entry: the first non-empty GID (RoCE v1 or IB)")
