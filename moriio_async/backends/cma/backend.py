"""CmaBackend: one-sided READ and WRITE between processes of one host, at memory speed.

Threads, per backend: the target port's accept thread and one thread per
initiator connected to it (``target.py``); per active queue pair: a worker
and a reader (``worker.py``, ``initiator.py``), plus ``threads - 1`` helpers
when windows are split. None of them touches asyncio; the worker's copies
run in ctypes calls, with the GIL released.

Settings: ``CmaOptions`` (``IOEngineConfig(cma=CmaOptions(...))``): ``threads`` a large window is
split over, ``round_bytes`` per window under the copy lock, ``split_bytes`` below which windows are
not split, ``ptracer`` (see ``permissions.py``), ``revoke_wait`` (how long deregistration waits for a
window an initiator is copying right now, usually about a millisecond, before it cuts that initiator
off), ``quiet_refusal`` (the engine sets it when it has another transport to fall back on, and logs
the one line itself; the kernel's refusal then stays an INFO line here).
"""

from __future__ import annotations

import mmap
import os
from typing import ClassVar

from ...status import Access
from ..base import BackendOptions, MemoryRegion, specific_options
from ..described import CmaFacts
from ..options import CmaOptions
from ..soft.backend import SoftBackend
from ..soft.cq import SoftCompletionQueue
from .kernel import yama_scope
from .pairstate import PairState
from .permissions import PtracerPolicy, has_cap_sys_ptrace
from .qp import CmaQueuePair
from .regions import LocalTable, table_flags
from .table import RegionTable
from .target import TargetPort
from .wire import VERSION

__all__ = ["CmaBackend"]


def _ns_inode(kind: str) -> int:
    try:
        return os.stat(f"/proc/self/ns/{kind}").st_ino
    except OSError:
        return 0  # no /proc view of it: peers that see none either compare equal, and the probe decides


class CmaBackend(SoftBackend[CmaQueuePair]):
    name: ClassVar[str] = "cma"

    def __init__(self, options: BackendOptions) -> None:
        super().__init__(options)
        own = self.tuning = specific_options(options, CmaOptions)
        self.policy = PtracerPolicy(own.ptracer)
        self.local = LocalTable()
        self.table = RegionTable()
        self.port = TargetPort(options, self.table, self.local, self.policy, own.revoke_wait)

    # -- shared memory ------------------------------------------------------------------

    def allocate_buffer(self, size: int) -> mmap.mmap:
        """A zeroed buffer backed by a sealed memfd: same-host peers map it and copy with memmove."""
        self._check_open()
        return self.local.allocate(size)

    def allocate_memory(self, size: int, access: Access | None = None) -> MemoryRegion:
        """``allocate_buffer`` then ``register_memory`` (all access by default); ``region.view`` is the buffer."""
        buffer = self.allocate_buffer(size)
        return self.register_memory(memoryview(buffer), Access.all() if access is None else access)

    # -- the contract -----------------------------------------------------------------

    def register_memory(self, buffer: memoryview, access: Access) -> MemoryRegion:
        self._check_open()
        region = self.local.register(buffer, access)
        try:
            # Published live but with no remote access bits: until ``export_memory`` a peer's check
            # refuses it (REM_ACCESS_ERR), as on tcp, where an unexported rkey is unknown.
            region.rkey = self.table.publish(region.addr, region.length, table_flags(Access(0)), region.alloc,
                                             region.alloc_off)  # fmt: skip
        except BaseException:
            self.local.remove(region)
            raise
        return region

    def export_memory(self, region: MemoryRegion) -> None:
        """From now on peers' checks grant ``region`` the remote access it was registered with."""
        self.table.grant(region.rkey, table_flags(region.access))

    def deregister_memory(self, region: MemoryRegion) -> None:
        """Revoke the region: every initiator's next check fails (one store in the shared table).

        Before it returns, it waits for a window an initiator is copying right now to end (its
        in-use word, ``inuse.py``: about a millisecond; at most ``revoke_wait``, after which that
        initiator is cut off); acknowledgements, unmapping and the slot's reuse are then handled
        by the port's threads, never waited for here. Locally, it waits likewise for a copy into
        or out of the region on this backend's own pairs."""
        found = self.local.remove(region)
        if found is None:
            return
        self.port.revoke(found)
        for qp in self._pairs():
            with qp.pair_state.copy_lock:
                pass

    def _new_qp(self, qp_num: int, cq: SoftCompletionQueue) -> CmaQueuePair:
        return CmaQueuePair(PairState(qp_num, cq), self.local, self.port, self.options, self.tuning, self._forget)

    def scope(self) -> str:
        """This host and the namespaces a peer must share: the boot id, the pid namespace (the pid in an
        endpoint means the same process), the net namespace (the abstract Unix socket) and the uid."""
        ns = [_ns_inode(kind) for kind in ("pid", "net")]
        return f"{self.port.boot}/pid:{ns[0]}/net:{ns[1]}/uid:{os.getuid()}"

    def describe(self) -> CmaFacts:
        sq_depth, max_sge = self._limits()
        return CmaFacts(
            backend="cma",
            socket="@" + self.port.name,
            pid=os.getpid(),
            boot_id=self.port.boot,
            wire_version=VERSION,
            yama_ptrace_scope=yama_scope(),
            cap_sys_ptrace=has_cap_sys_ptrace(),
            ptracer=self.policy.policy,
            sq_depth=sq_depth,
            max_sge=max_sge,
            round_bytes=self.tuning.round_bytes,
            threads=self.tuning.threads,
            split_bytes=self.tuning.split_bytes,
        )

    def _close_pairs(self, qps: list[CmaQueuePair]) -> None:
        self.port.quiesce()  # first: no peer's window touches our memory once close returns
        super()._close_pairs(qps)

    def _stop(self) -> None:
        self.port.close()

    def _forget_memory(self) -> None:
        self.local.clear()
        self.table.close()
