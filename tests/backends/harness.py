"""What the backend conformance tests share: options, a connected pair, request builders, a CQ waiter.

Everything here is plain synchronous code against the contract in
``moriio_async/backends/base.py``; nothing is backend-specific.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from moriio_async.backends import open_backend
from moriio_async.backends.base import Backend, BackendOptions, CompletionQueue, MemoryRegion, QueuePair
from moriio_async.backends.verbs import VerbsOptions
from moriio_async.status import Access, Opcode, WcStatus
from moriio_async.work import Sge, WorkCompletion, WorkRequest

ALL = Access.all()
IN_PROCESS_ONLY = {"mock"}
"""Backends whose pairs connect within one process only: a peer that dies is closed here, not killed."""
WAIT = 15.0
"""Generous upper bound for anything that should take milliseconds (a loaded 2-core box)."""


def backend_names() -> list[str]:
    """Backends the suite runs against: MORIIO_TEST_BACKENDS, a comma list (default "mock,tcp,cma")."""
    return [b.strip() for b in os.environ.get("MORIIO_TEST_BACKENDS", "mock,tcp,cma").split(",") if b.strip()]


CQ_DEPTH = 8192
"""Completion-queue depth of the pairs the harness makes (deep enough for every test's batches)."""


def make_options(backend: str = "verbs", **overrides: Any) -> BackendOptions:
    """Test defaults, then MORIIO_TEST_BACKEND_OPTIONS (JSON: e.g. the verbs device), then ``overrides``.

    The environment's verbs settings go into ``specific`` only for the verbs backend (a test that opens
    another backend by name says so: ``make_options("tcp")``; a backend refuses another's options)."""
    options = BackendOptions(retry_timeout=2.0, connect_timeout=10.0)
    env = json.loads(os.environ.get("MORIIO_TEST_BACKEND_OPTIONS", "{}"))
    verbs = {k: env.pop(k) for k in list(env) if k in VerbsOptions.__dataclass_fields__}
    if verbs and backend == "verbs":  # the verbs device and its settings: the suite runs on verbs alone then
        env["specific"] = VerbsOptions(**verbs)
    return replace(options, **{**env, **overrides})


def dead_peer_deadline(options: BackendOptions) -> float:
    """How long a backend may take to notice a dead peer, with a generous margin.

    TCP waits ``retry_timeout`` of silence; verbs retries ``retry_cnt`` times
    an ACK timeout of 4.096 us * 2**qp_timeout.
    """
    own = options.specific if isinstance(options.specific, VerbsOptions) else VerbsOptions()
    verbs = 4.096e-6 * 2**own.qp_timeout * (own.retry_cnt + 1)
    return 2 * max(options.retry_timeout, verbs) + 5.0


def random_bytes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def digest(buf: np.ndarray) -> str:
    return hashlib.blake2b(memoryview(buf), digest_size=16).hexdigest()


class CqWaiter:
    """Collects completions with only the channel protocol: wait readable, get_event, req_notify, poll.

    A missed wakeup shows up as a wait that runs into its (generous) deadline.
    """

    def __init__(self, cq: CompletionQueue) -> None:
        self.cq = cq
        self.fd = cq.fileno()
        self.wakeups = 0
        cq.req_notify()

    def _sleep_until_event(self, deadline: float) -> bool:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        if self.fd < 0:  # a backend without a channel fd: poll (allowed by the contract)
            time.sleep(min(remaining, 0.001))
            return True
        readable, _, _ = select.select([self.fd], [], [], remaining)
        if not readable:
            return False
        self.wakeups += 1
        self.cq.get_event()
        self.cq.req_notify()
        return True

    def wait(self, n: int, timeout: float = WAIT) -> list[WorkCompletion]:
        """Exactly ``n`` completions (never consumes more), or fail with what arrived."""
        out: list[WorkCompletion] = []
        deadline = time.monotonic() + timeout
        while True:
            while len(out) < n:
                got = self.cq.poll(n - len(out))
                if not got:
                    break
                out.extend(got)
            if len(out) >= n:
                return out
            if not self._sleep_until_event(deadline):
                raise AssertionError(f"timed out after {timeout}s with {len(out)} of {n} completions: {out}")

    def wait_some(self, timeout: float = WAIT, max_entries: int = 256) -> list[WorkCompletion]:
        """At least one completion."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.cq.poll(max_entries)
            if got:
                return got
            if not self._sleep_until_event(deadline):
                raise AssertionError(f"no completion within {timeout}s")

    def expect_none(self, grace: float = 0.3) -> None:
        """No completion arrives within ``grace`` seconds."""
        deadline = time.monotonic() + grace
        while self._sleep_until_event(deadline):
            pass
        got = self.cq.poll(64)
        assert not got, f"unexpected completions: {got}"


@dataclass
class Side:
    backend: Backend
    cq: CompletionQueue
    qp: QueuePair
    buf: np.ndarray
    mr: MemoryRegion
    regions: list[MemoryRegion] = field(default_factory=list)
    """Every region still registered (closed at teardown)."""

    def register(self, buf: np.ndarray, access: Access, *, export: bool = True) -> MemoryRegion:
        """Register ``buf``, exported to the peer unless ``export=False``."""
        mr = self.backend.register_memory(memoryview(buf), access)
        if export:
            self.backend.export_memory(mr)
        self.regions.append(mr)
        return mr

    def deregister(self, mr: MemoryRegion) -> None:
        self.regions.remove(mr)
        self.backend.deregister_memory(mr)

    def sge(self, offset: int, length: int, mr: MemoryRegion | None = None) -> Sge:
        mr = mr or self.mr
        return Sge(mr.addr + offset, length, mr.lkey)


@dataclass
class Pair:
    """A connected queue pair: ``a`` is active (it posts), ``b`` passive (its memory is the target)."""

    name: str
    options: BackendOptions
    a: Side
    b: Side
    waiter: CqWaiter

    def wr(
        self,
        wr_id: int,
        opcode: Opcode,
        local: Sequence[tuple[int, int]],
        remote_offset: int,
        *,
        signaled: bool = True,
        rkey: int | None = None,
        remote_addr: int | None = None,
        local_mr: MemoryRegion | None = None,
    ) -> WorkRequest:
        """A request between A's ``local`` (offset, length) list and B's region at ``remote_offset``."""
        sges = tuple(self.a.sge(off, n, local_mr) for off, n in local)
        addr = self.b.mr.addr + remote_offset if remote_addr is None else remote_addr
        return WorkRequest(wr_id, opcode, sges, addr, self.b.mr.rkey if rkey is None else rkey, signaled)

    def write(self, wr_id: int, local_offset: int, length: int, remote_offset: int, **kw: Any) -> WorkRequest:
        return self.wr(wr_id, Opcode.RDMA_WRITE, [(local_offset, length)], remote_offset, **kw)

    def read(self, wr_id: int, local_offset: int, length: int, remote_offset: int, **kw: Any) -> WorkRequest:
        return self.wr(wr_id, Opcode.RDMA_READ, [(local_offset, length)], remote_offset, **kw)

    def run(self, wrs: Sequence[WorkRequest], expect: int | None = None) -> list[WorkCompletion]:
        """Post ``wrs`` and wait for ``expect`` completions (default: one per signaled request)."""
        self.a.qp.post_send(wrs)
        n = sum(w.signaled for w in wrs) if expect is None else expect
        return self.waiter.wait(n)


@dataclass
class FakeTargetClient:
    """A TCP initiator's queue pair dialled at a fake target (a test's own socket server), with
    ``size`` bytes of registered memory to read into."""

    buf: np.ndarray
    mr: MemoryRegion
    qp: QueuePair
    waiter: CqWaiter

    @classmethod
    def dial(cls, backend: Backend, port: int, size: int) -> FakeTargetClient:
        buf = np.zeros(size, np.uint8)
        mr = backend.register_memory(memoryview(buf), Access.all())
        cq = backend.create_cq(8)
        qp = backend.create_qp(cq)
        qp.connect({"backend": "tcp", "accepting": True, "host": "127.0.0.1", "port": port, "qp_num": 99,
                    "token": "ab" * 16})  # fmt: skip
        return cls(buf, mr, qp, CqWaiter(cq))

    def read(self, wr_id: int, offset: int, length: int) -> None:
        """Post one READ of ``length`` bytes into ``buf[offset:]`` from remote 0x1000, rkey 7."""
        self.qp.post_send([WorkRequest(wr_id, Opcode.RDMA_READ, (Sge(self.mr.addr + offset, length, self.mr.lkey),),
                                       0x1000, 7)])  # fmt: skip


def connect(a: QueuePair, b: QueuePair) -> None:
    """The contract's order; endpoints travel as JSON, as they would between machines."""
    ep_a = json.loads(json.dumps(dict(a.endpoint())))
    b.connect(ep_a)
    ep_b = json.loads(json.dumps(dict(b.endpoint())))
    a.connect(ep_b)


class PairFactory:
    """Opens pairs for a test and closes everything at teardown (QPs, CQs, regions, backends)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._pairs: list[Pair] = []

    def __call__(
        self,
        size_a: int = 1 << 20,
        size_b: int = 1 << 20,
        *,
        access_b: Access = ALL,
        seed: int = 1,
        **options: Any,
    ) -> Pair:
        opts = make_options(**options)
        sides = []
        for size, access, fill in ((size_a, Access.all(), 0), (size_b, access_b, 1)):
            backend = open_backend(self.name, opts)
            cq = backend.create_cq(CQ_DEPTH)
            qp = backend.create_qp(cq)
            buf = random_bytes(size, seed + fill) if fill else np.zeros(size, np.uint8)
            mr = backend.register_memory(memoryview(buf), access)
            backend.export_memory(mr)
            sides.append(Side(backend, cq, qp, buf, mr, [mr]))
        a, b = sides
        connect(a.qp, b.qp)
        pair = Pair(self.name, opts, a, b, CqWaiter(a.cq))
        self._pairs.append(pair)
        return pair

    def close(self) -> None:
        for pair in self._pairs:
            for side in (pair.a, pair.b):
                side.qp.close()
            for side in (pair.a, pair.b):
                side.cq.close()
                for mr in list(side.regions):
                    side.deregister(mr)
                side.backend.close()


def statuses(wcs: Iterable[WorkCompletion]) -> list[WcStatus]:
    return [wc.status for wc in wcs]


def wr_ids(wcs: Iterable[WorkCompletion]) -> list[int]:
    return [wc.wr_id for wc in wcs]
