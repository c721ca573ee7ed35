"""A peer that dies or stalls: the oldest outstanding request fails RETRY_EXC_ERR, the rest flush."""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from moriio_async.backends import open_backend
from moriio_async.backends.base import Backend, BackendOptions, QpState, QueuePair
from moriio_async.backends.options import VerbsOptions
from moriio_async.backends.tcp import Hooks
from moriio_async.status import Access, Opcode, WcStatus
from moriio_async.work import Sge, WorkCompletion, WorkRequest

from .harness import IN_PROCESS_ONLY, WAIT, CqWaiter, PairFactory, dead_peer_deadline, make_options, statuses, wr_ids

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[2]
CHUNK = 256 << 10


# What the oldest outstanding request reports when the peer dies. Over a wire (TCP, or verbs
# between hosts: tests/verbs/test_two_guests.py) nothing answers, so the transport's retries run
# out. Soft-RoCE with both ends on one device knows at once that the peer's QP was destroyed and
# NAKs the request, which rxe reports as REM_ACCESS_ERR: a different cause, equally final.
PEER_LOST = {"tcp": {WcStatus.RETRY_EXC_ERR}, "verbs": {WcStatus.RETRY_EXC_ERR, WcStatus.REM_ACCESS_ERR}}


def assert_peer_lost(wcs: list[WorkCompletion], posted: int, backend_name: str = "tcp") -> None:
    """SUCCESS*, then one root-cause error (RETRY_EXC_ERR over a wire), then WR_FLUSH_ERR for
    everything else posted, in order."""
    assert wr_ids(wcs) == list(range(posted))
    sts = statuses(wcs)
    ok = sts.count(WcStatus.SUCCESS)
    assert sts[:ok] == [WcStatus.SUCCESS] * ok, sts
    assert ok < posted, "the peer died but everything succeeded"
    assert sts[ok] in PEER_LOST.get(backend_name, {WcStatus.RETRY_EXC_ERR}), sts[ok:]
    assert sts[ok + 1 :] == [WcStatus.WR_FLUSH_ERR] * (posted - ok - 1)


class RemotePeer:
    """A passive target that can die: its own process (SIGKILL) where the backend crosses processes,
    else (the mock) a backend in this process that is closed without ceremony, as a crash would."""

    def __init__(self, backend_name: str, opts: BackendOptions, size: int) -> None:
        self.backend_name = backend_name
        self.opts = opts
        self.size = size
        self.proc: subprocess.Popen[str] | None = None
        self.local: Backend | None = None

    def connect(self, qp: QueuePair) -> dict[str, Any]:
        """Connect ``qp`` to the peer; its endpoint and region (addr, rkey)."""
        if self.backend_name in IN_PROCESS_ONLY:
            self.local = backend = open_backend(self.backend_name, self.opts)
            peer_qp = backend.create_qp(backend.create_cq(1024))
            self.buf = np.zeros(self.size, np.uint8)
            mr = backend.register_memory(memoryview(self.buf), Access.all())
            backend.export_memory(mr)
            peer_qp.connect(json.loads(json.dumps(dict(qp.endpoint()))))
            peer = {"endpoint": dict(peer_qp.endpoint()), "addr": mr.addr, "rkey": mr.rkey}
        else:
            env_opts = {k: v for k, v in dataclasses.asdict(self.opts).items() if k != "specific"}
            if isinstance(self.opts.specific, VerbsOptions):  # the guest suite's device: rebuilt over there
                env_opts["verbs"] = {
                    k: v for k, v in dataclasses.asdict(self.opts.specific).items() if k != "fault_plan"
                }
            # Prepend: inside the guest PYTHONPATH already points at the cached pyverbs.
            path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
            self.proc = proc = subprocess.Popen(
                [sys.executable, "-m", "tests.backends.peer_process", self.backend_name, json.dumps(env_opts),
                 str(self.size)],
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env={**os.environ, "PYTHONPATH": path},
            )  # fmt: skip
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(json.dumps(dict(qp.endpoint())) + "\n")
            proc.stdin.flush()
            assert select.select([proc.stdout], [], [], 60)[0], "the peer process did not answer"
            peer = json.loads(proc.stdout.readline())
        qp.connect(peer["endpoint"])
        return peer

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
        elif self.local is not None:
            self.local.close()

    def cleanup(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.communicate()  # reaps it and closes the pipes
        if self.local is not None:
            self.local.close()


def test_peer_killed_mid_batch(backend_name: str) -> None:
    opts = make_options(retry_timeout=1.0, sq_depth=32)
    backend = open_backend(backend_name, opts)
    cq = backend.create_cq(4096)
    qp = backend.create_qp(cq)
    buf = np.ones(8 << 20, np.uint8)
    mr = backend.register_memory(memoryview(buf), Access.all())
    remote = RemotePeer(backend_name, opts, len(buf))
    try:
        peer = remote.connect(qp)
        slots = len(buf) // CHUNK

        def wr(i: int) -> WorkRequest:
            off = (i % slots) * CHUNK
            return WorkRequest(
                i, Opcode.RDMA_WRITE, (Sge(mr.addr + off, CHUNK, mr.lkey),), peer["addr"] + off, peer["rkey"]
            )

        # Keep the queue full (every request signaled), kill the peer after some successes,
        # stop posting at the first failure, then collect everything posted.
        waiter = CqWaiter(cq)
        wcs: list[WorkCompletion] = []
        posted, killed_at, failed_at = 0, 0.0, 0.0
        while not failed_at or len(wcs) < posted:
            if not failed_at:
                room = qp.max_send_wr - (posted - len(wcs))
                if room:
                    qp.post_send([wr(posted + i) for i in range(room)])
                    posted += room
            if not killed_at and len(wcs) >= 40:
                remote.kill()
                killed_at = time.monotonic()
            got = waiter.wait_some(timeout=WAIT)
            wcs += got
            if not failed_at and any(not wc.ok for wc in got):
                failed_at = time.monotonic()
                assert killed_at, f"a failure before the kill: {got}"
        assert failed_at - killed_at <= dead_peer_deadline(opts), failed_at - killed_at
        assert_peer_lost(wcs, posted, backend_name)
        assert qp.state == QpState.ERR
    finally:
        remote.cleanup()
        qp.close()
        cq.close()
        backend.deregister_memory(mr)
        backend.close()


def test_passive_backend_closed_while_requests_are_outstanding(pairs: PairFactory) -> None:
    pair = pairs(8 << 20, 8 << 20, retry_timeout=1.0, sq_depth=32)
    n = 32
    pair.a.qp.post_send([pair.write(i, i * CHUNK, CHUNK, i * CHUNK) for i in range(n)])
    pair.b.qp.close()
    pair.b.backend.close()
    started = time.monotonic()
    wcs = pair.waiter.wait(n, timeout=dead_peer_deadline(pair.options) + WAIT)
    if all(wc.ok for wc in wcs):  # everything finished before the close: fail the next one instead
        pair.a.qp.post_send([pair.write(n, 0, CHUNK, 0)])
        wcs += pair.waiter.wait(1, timeout=dead_peer_deadline(pair.options) + WAIT)
        n += 1
    assert time.monotonic() - started <= dead_peer_deadline(pair.options) + 1
    assert_peer_lost(wcs, n)


class Stall(Hooks):
    """A TCP fault hook: the target stops answering (socket open) until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def on_request(self, qp_num: int, opcode: int, rkey: int, remote_addr: int, length: int) -> None:
        self.entered.set()
        self.release.wait(30)


@pytest.mark.only_backends("tcp", reason="stalls the target through the TCP backend's fault hooks")
def test_stalled_peer_fails_after_retry_timeout(pairs: PairFactory) -> None:
    pair = pairs(4 << 20, 4 << 20, retry_timeout=0.5)
    stall = Stall()
    pair.b.qp.hooks = stall  # type: ignore[attr-defined]
    try:
        started = time.monotonic()
        pair.a.qp.post_send([pair.write(i, i * CHUNK, CHUNK, i * CHUNK) for i in range(16)])
        wcs = pair.waiter.wait(16, timeout=0.5 + WAIT)
        elapsed = time.monotonic() - started
        assert stall.entered.is_set()
        assert_peer_lost(wcs, 16)
        assert wcs[0].status is WcStatus.RETRY_EXC_ERR
        assert elapsed <= 2 * 0.5 + 5.0, elapsed  # declared after one to two retry_timeouts of no progress
    finally:
        stall.release.set()


def test_unsignaled_requests_to_a_dead_peer_still_fail(pairs: PairFactory) -> None:
    """No success completion is asked for, yet a vanished peer is still reported, in order."""
    pair = pairs(8 << 20, 8 << 20, retry_timeout=1.0, sq_depth=64)
    n = 32
    pair.a.qp.post_send([pair.write(i, i * CHUNK, CHUNK, i * CHUNK, signaled=False) for i in range(n)])
    pair.b.qp.close()
    pair.b.backend.close()
    pair.a.qp.post_send([pair.write(n, 0, CHUNK, 0)])  # the one signaled request
    wcs: list[WorkCompletion] = []
    deadline = time.monotonic() + dead_peer_deadline(pair.options) + WAIT
    while not wcs or wcs[-1].wr_id != n:
        wcs += pair.waiter.wait_some(timeout=max(0.0, deadline - time.monotonic()))
    first = wcs[0].wr_id
    assert wr_ids(wcs) == list(range(first, n + 1)), "a failure or flush went missing"
    assert statuses(wcs) == [WcStatus.RETRY_EXC_ERR] + [WcStatus.WR_FLUSH_ERR] * (n - first)
