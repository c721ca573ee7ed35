"""Opening, connecting, describing and closing: states, keys, and no leaked threads or fds."""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest

from moriio_async.backends import open_backend
from moriio_async.backends.base import Backend, CompletionQueue, MemoryRegion, QpState, QueuePair
from moriio_async.status import Access, Opcode
from moriio_async.work import Sge, WorkRequest

from .harness import ALL, connect, make_options

pytestmark = pytest.mark.timeout(60)


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def leftovers(threads: set[threading.Thread], fds: set[str]) -> tuple[set[str], set[str]]:
    """Threads and fds beyond the baseline (close joins; allow a moment for the interpreter's bookkeeping)."""
    deadline = time.monotonic() + 2.0
    while True:
        extra_threads = {t.name for t in threading.enumerate() if t not in threads and t.is_alive()}
        extra_fds = open_fds() - fds
        if (not extra_threads and not extra_fds) or time.monotonic() > deadline:
            return extra_threads, extra_fds
        time.sleep(0.01)


@dataclass
class Busy:
    """Two backends, two connected pairs from a to b, and requests still outstanding on both."""

    a: Backend
    b: Backend
    cqs: list[CompletionQueue] = field(default_factory=list)
    qps: list[QueuePair] = field(default_factory=list)
    mrs: list[tuple[Backend, MemoryRegion]] = field(default_factory=list)
    bufs: list[np.ndarray] = field(default_factory=list)

    @classmethod
    def open(cls, name: str) -> Busy:
        opts = make_options(sq_depth=64)
        busy = cls(open_backend(name, opts), open_backend(name, opts))
        cq_a, cq_b = busy.a.create_cq(256), busy.b.create_cq(256)
        busy.cqs += [cq_a, cq_b]
        busy.bufs += [np.ones(4 << 20, np.uint8), np.zeros(4 << 20, np.uint8)]
        mr_a = busy.a.register_memory(memoryview(busy.bufs[0]), ALL)
        mr_b = busy.b.register_memory(memoryview(busy.bufs[1]), ALL)
        busy.b.export_memory(mr_b)
        busy.mrs += [(busy.a, mr_a), (busy.b, mr_b)]
        sges = (Sge(mr_a.addr, mr_a.length, mr_a.lkey),)
        for _ in range(2):
            qa, qb = busy.a.create_qp(cq_a), busy.b.create_qp(cq_b)
            connect(qa, qb)
            busy.qps += [qa, qb]
            # A batch's wr_ids are consecutive (the contract).
            qa.post_send([WorkRequest(i, Opcode.RDMA_WRITE, sges, mr_b.addr, mr_b.rkey) for i in range(1, 9)])
        return busy


def test_close_in_contract_order_releases_threads_and_fds(backend_name: str) -> None:
    threads, fds = set(threading.enumerate()), open_fds()
    busy = Busy.open(backend_name)
    for qp in busy.qps:
        qp.close()
    for cq in busy.cqs:
        cq.close()
    for backend, mr in busy.mrs:
        backend.deregister_memory(mr)
    busy.a.close()
    busy.b.close()
    extra_threads, extra_fds = leftovers(threads, fds)
    assert not extra_threads, f"threads left running: {extra_threads}"
    assert not extra_fds, f"fds left open: {extra_fds}"


def test_backend_close_alone_releases_everything(backend_name: str) -> None:
    threads, fds = set(threading.enumerate()), open_fds()
    busy = Busy.open(backend_name)
    busy.a.close()  # requests outstanding, queue pairs, CQs and regions still open
    busy.b.close()
    busy.a.close()  # idempotent
    extra_threads, extra_fds = leftovers(threads, fds)
    assert not extra_threads, f"threads left running: {extra_threads}"
    assert not extra_fds, f"fds left open: {extra_fds}"


def test_states_endpoints_and_describe(backend_name: str) -> None:
    opts = make_options()
    a, b = open_backend(backend_name, opts), open_backend(backend_name, opts)
    try:
        assert a.describe().backend == backend_name
        cq_a, cq_b = a.create_cq(16), b.create_cq(16)
        qa, qb = a.create_qp(cq_a), b.create_qp(cq_b)
        assert qa.state == QpState.INIT and qb.state == QpState.INIT
        assert qa.max_send_wr >= 1 and qa.max_sge >= 1
        json.dumps(dict(qa.endpoint()))
        connect(qa, qb)
        assert qa.state == QpState.RTS and qb.state == QpState.RTS
        qa.to_error()
        assert qa.state == QpState.ERR
        for x in (qa, qb, cq_a, cq_b):
            x.close()
    finally:
        a.close()
        b.close()


def test_register_memory_reports_address_length_and_unique_keys(backend_name: str) -> None:
    backend = open_backend(backend_name, make_options())
    try:
        bufs = [np.zeros(4096 + i, np.uint8) for i in range(64)]
        mrs = [backend.register_memory(memoryview(buf), ALL) for buf in bufs]
        for buf, mr in zip(bufs, mrs, strict=True):
            assert mr.addr == buf.ctypes.data
            assert mr.length == buf.nbytes
            assert 0 < mr.lkey < 2**32 and 0 < mr.rkey < 2**32
            assert mr.access == ALL
        assert len({mr.lkey for mr in mrs}) == len(mrs)
        assert len({mr.rkey for mr in mrs}) == len(mrs)
        ro = backend.register_memory(memoryview(np.zeros(64, np.uint8)), Access.REMOTE_READ)
        for mr in [*mrs, ro]:
            backend.deregister_memory(mr)
    finally:
        backend.close()
