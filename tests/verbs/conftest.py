"""Fixtures for the tests that need real verbs (inside the Soft-RoCE guest: MORIIO_GUEST=1)."""

from __future__ import annotations

import os
import select
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from moriio_async.backends import open_backend
from moriio_async.backends.base import Backend, BackendOptions, CompletionQueue, MemoryRegion, QueuePair
from moriio_async.backends.verbs import VerbsOptions
from moriio_async.status import Access, Opcode
from moriio_async.work import Sge, WorkCompletion, WorkRequest

IN_GUEST = os.environ.get("MORIIO_GUEST") == "1"
NOT_IN_GUEST = "needs real RDMA: runs inside the Soft-RoCE guest (MORIIO_GUEST=1); see tests/verbs/test_guest_suite.py"

guest_only = pytest.mark.skipif(not IN_GUEST, reason=NOT_IN_GUEST)


def guest_options(**overrides: object) -> BackendOptions:
    own: dict[str, object] = {"device": os.environ.get("MORIIO_GUEST_DEVICE", "rxe0"), "qp_timeout": 12}
    common = {k: v for k, v in overrides.items() if k not in VerbsOptions.__dataclass_fields__}
    own.update({k: v for k, v in overrides.items() if k in VerbsOptions.__dataclass_fields__})
    host = os.environ.get("MORIIO_GUEST_SELF_IP") or BackendOptions.host
    return BackendOptions(host=host, specific=VerbsOptions(**own), **common)  # type: ignore[arg-type]


def drain(cq: CompletionQueue, want: int, timeout: float) -> list[WorkCompletion]:
    """The runtime's reader loop, blocking: get_event, req_notify, poll until empty; until ``want`` or timeout."""
    got: list[WorkCompletion] = []
    deadline = time.monotonic() + timeout
    fd = cq.fileno()
    cq.req_notify()
    while len(got) < want and time.monotonic() < deadline:
        while batch := cq.poll(64):
            got += batch
        if len(got) >= want:
            break
        if fd >= 0:
            select.select([fd], [], [], min(0.2, max(0.0, deadline - time.monotonic())))
            cq.get_event()
            cq.req_notify()
        else:
            time.sleep(0.001)
    return got


def write(wr_id: int, src: MemoryRegion, dst_addr: int, rkey: int, size: int, *, offset: int = 0,
          signaled: bool = True, opcode: Opcode = Opcode.RDMA_WRITE) -> WorkRequest:  # fmt: skip
    return WorkRequest(wr_id, opcode, (Sge(src.addr + offset, size, src.lkey),), dst_addr, rkey, signaled)


@dataclass
class Pair:
    backend: Backend
    cq: CompletionQueue
    active: QueuePair
    passive: QueuePair
    src: MemoryRegion
    dst: MemoryRegion
    src_buf: bytearray
    dst_buf: bytearray


def connect(backend: Backend, cq: CompletionQueue) -> tuple[QueuePair, QueuePair]:
    active, passive = backend.create_qp(cq), backend.create_qp(cq)
    passive.connect(active.endpoint())
    active.connect(passive.endpoint())
    return active, passive


@pytest.fixture
def backend() -> Iterator[Backend]:
    if not IN_GUEST:
        pytest.skip(NOT_IN_GUEST)
    opened = open_backend("verbs", guest_options(retry_cnt=3))
    yield opened
    opened.close()


@pytest.fixture
def pair(backend: Backend) -> Pair:
    size = 1 << 20
    src_buf = bytearray(os.urandom(size))
    dst_buf = bytearray(size)
    src = backend.register_memory(memoryview(src_buf), Access.all())
    dst = backend.register_memory(memoryview(dst_buf), Access.all())
    cq = backend.create_cq(4096)
    active, passive = connect(backend, cq)
    return Pair(backend, cq, active, passive, src, dst, src_buf, dst_buf)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """After a host run that booted the Soft-RoCE guest: its devices and every guest test's outcome."""
    from . import test_guest_suite as bridge

    for guests, run in sorted(bridge.finished_runs().items()):
        terminalreporter.section(f"Soft-RoCE guest run: {guests} guest(s), exit {run.exit_code}, {run.seconds:.0f}s")
        for line in run.devices:
            terminalreporter.write_line(line)
        counts: dict[str, int] = {}
        for (classname, name), result in sorted(run.results.items()):
            counts[result.outcome] = counts.get(result.outcome, 0) + 1
            terminalreporter.write_line(f"{result.outcome.upper():8} {classname}::{name} ({result.seconds:.2f}s)")
        terminalreporter.write_line(", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())))
