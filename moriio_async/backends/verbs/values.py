"""Plain values and helpers ``_pyverbs`` takes and returns: nothing here imports pyverbs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

from ...errors import MoriioError

__all__ = ["INSTALL_HINT", "NO_DEVICE_HINT", "PathParams", "RawCompletion", "VerbsError", "event_fds"]

INSTALL_HINT = (
    "pip install moriio-async[verbs] (pyverbs needs rdma-core >= 57 libs: if the import fails on "
    "IBVERBS_PRIVATE_*, point LD_LIBRARY_PATH at rdma-core's lib/), or use backend='tcp'"
)
NO_DEVICE_HINT = (
    "load Soft-RoCE on a machine without an RDMA NIC: modprobe rdma_rxe && rdma link add rxe0 type rxe "
    "netdev eth0; or use backend='tcp'"
)

EVENT_FD_LINK = "anon_inode:[infinibandevent]"


class VerbsError(MoriioError):
    """A verbs call failed; ``errno`` is the error number rdma-core reported (0 if none)."""

    def __init__(self, message: str, *, errno: int = 0, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.errno = errno


def event_fds() -> set[int]:
    found: set[int] = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}") == EVENT_FD_LINK:
                found.add(int(name))
        except (OSError, ValueError):
            continue
    return found


class RawCompletion(NamedTuple):
    """One polled work completion's numbers, as ``ibv_wc`` holds them (the CQ makes a ``WorkCompletion`` of it).

    A NamedTuple, not a frozen dataclass: one is built per polled completion, and a frozen
    dataclass pays an ``object.__setattr__`` per field (as ``WorkCompletion`` says).
    """

    wr_id: int
    status: int
    vendor_err: int
    qp_num: int
    byte_len: int


@dataclass(frozen=True, slots=True)
class PathParams:
    """What RTR and RTS need, already clipped to the device."""

    port: int
    sgid_index: int
    dgid: str
    dlid: int
    is_global: bool
    dest_qp_num: int
    rq_psn: int
    sq_psn: int
    path_mtu: int
    max_dest_rd_atomic: int
    max_rd_atomic: int
    timeout: int
    retry_cnt: int
    rnr_retry: int
    min_rnr_timer: int = 12
