"""The cma backend's own machinery: revocation, shared-memory allocations, split windows, permissions."""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from moriio_async.backends import open_backend
from moriio_async.backends.base import MemoryRegion, QpState
from moriio_async.backends.cma import CmaBackend, CmaOptions, CmaQueuePair, VendorErr, initiator, wire
from moriio_async.backends.cma.inuse import ANY, InUse
from moriio_async.backends.cma.iov import Mover, segments, window
from moriio_async.backends.tcp import TcpOptions
from moriio_async.errors import InvalidArgument
from moriio_async.status import Access, Opcode, WcStatus
from moriio_async.work import Sge, WorkCompletion, WorkRequest

from .harness import WAIT, CqWaiter, Pair, PairFactory, make_options, random_bytes, statuses, wr_ids
from .test_peer_failure import assert_peer_lost

# Every test takes ``backend_name`` so that it is generated only when cma is under test.
pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.only_backends("cma", reason="tests the cma backend's revocation, shared memory and permissions"),
]

ROOT = Path(__file__).resolve().parents[2]
SLOT_MASK = 0xFFFF


def cma(backend: object) -> CmaBackend:
    assert isinstance(backend, CmaBackend)
    return backend


def eventually(predicate: Any, timeout: float = WAIT) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return bool(predicate())


def shared_region(pair: Pair, size: int) -> tuple[MemoryRegion, np.ndarray]:
    """A memfd allocation on the target side, registered; and a uint8 array over it."""
    mr = cma(pair.b.backend).allocate_memory(size)
    pair.b.backend.export_memory(mr)  # peers reach only exported regions
    pair.b.regions.append(mr)
    return mr, np.frombuffer(mr.view, dtype=np.uint8)


def to(mr: MemoryRegion, pair: Pair, wr_id: int, op: Opcode, local: list[tuple[int, int]], off: int) -> WorkRequest:
    sges = tuple(pair.a.sge(o, n) for o, n in local)
    return WorkRequest(wr_id, op, sges, mr.addr + off, mr.rkey)


@pytest.mark.parametrize("opcode", [Opcode.RDMA_WRITE, Opcode.RDMA_READ])
def test_a_descriptor_from_before_a_deregistration_fails_and_touches_nothing(
    pairs: PairFactory, opcode: Opcode
) -> None:
    pair = pairs(1 << 20, 1 << 20)
    stale = pair.b.register(pair.b.buf, Access.all())
    pair.a.buf[:] = 0xAB
    before_a, before_b = pair.a.buf.copy(), pair.b.buf.copy()
    pair.b.deregister(stale)
    wcs = pair.run([to(stale, pair, 0, opcode, [(0, 4096)], 0), pair.write(1, 0, 4096, 0)], expect=2)
    assert statuses(wcs) == [WcStatus.REM_ACCESS_ERR, WcStatus.WR_FLUSH_ERR]
    assert wcs[0].vendor_err in (VendorErr.REMOTE_REVOKED, VendorErr.UNKNOWN_RKEY)
    assert np.array_equal(pair.a.buf, before_a) and np.array_equal(pair.b.buf, before_b)
    # Every initiator acknowledged: the slot is free again, and the key never comes back.
    table = cma(pair.b.backend).table
    assert eventually(lambda: int(table.records["rkey"][stale.rkey & SLOT_MASK]) == 0)
    again = pair.b.register(pair.b.buf, Access.all())
    assert again.rkey != stale.rkey


def hold_back_the_end(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """The initiator's reader sees its connection end ``seconds`` late (what a busy machine can do)."""
    real = initiator.receive

    def late_to_see_the_end(sock: socket.socket, want_fd: bool = False) -> tuple[bytes, int | None]:
        try:
            return real(sock, want_fd)
        except (OSError, wire.ProtocolError):
            time.sleep(seconds)
            raise

    monkeypatch.setattr(initiator, "receive", late_to_see_the_end)


def test_after_the_target_closed_its_backend_no_request_moves_a_byte(
    pairs: PairFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``close`` returns with every peer's next check failing as from a vanished peer (RETRY_EXC_ERR),
    even while that peer's reader has not yet seen the connection end (held back a second here):
    memory the application frees after ``close`` is never written. (CI caught this as a flake.)"""
    hold_back_the_end(monkeypatch, 1.0)
    pair = pairs(1 << 20, 1 << 20)
    pair.a.buf[:] = 0xCD
    before = pair.b.buf.copy()
    pair.b.backend.close()
    wcs = pair.run([pair.write(0, 0, 4096, 0), pair.write(1, 4096, 4096, 4096)], expect=2)
    assert statuses(wcs) == [WcStatus.RETRY_EXC_ERR, WcStatus.WR_FLUSH_ERR]
    assert wcs[0].vendor_err == VendorErr.PEER_CLOSED
    assert np.array_equal(pair.b.buf, before), "a byte was written after the target's close returned"


def test_shared_allocation_moves_bytes_through_the_mapping_and_is_unmapped_on_revocation(pairs: PairFactory) -> None:
    pair = pairs(4 << 20, 1 << 20)
    mr, shared = shared_region(pair, 4 << 20)
    pair.a.buf[:] = random_bytes(4 << 20, 7)
    # Scattered SGEs of odd lengths, three per request.
    layout = [[(i * 65536, 1000), (i * 65536 + 5000, 3000), (i * 65536 + 20000, 9)] for i in range(48)]
    wrs = [to(mr, pair, i, Opcode.RDMA_WRITE, sg, i * 4009) for i, sg in enumerate(layout)]
    assert all(wc.ok for wc in pair.run(wrs))
    for i, sg in enumerate(layout):
        expect = np.concatenate([pair.a.buf[o : o + n] for o, n in sg])
        assert np.array_equal(shared[i * 4009 : i * 4009 + len(expect)], expect)
    qp = pair.a.qp
    assert isinstance(qp, CmaQueuePair) and qp.link is not None
    assert len(qp.link.maps) == 1, "the shared allocation was not mapped by the initiator"
    shared[: 1 << 20] = 0x5A
    assert all(wc.ok for wc in pair.run([to(mr, pair, 100, Opcode.RDMA_READ, [(3 << 20, 1 << 20)], 0)]))
    assert bool((pair.a.buf[3 << 20 :] == 0x5A).all())
    link = qp.link
    pair.b.deregister(mr)
    assert eventually(lambda: not link.maps), "the initiator kept the mapping after the revocation"
    before = shared.copy()
    wcs = pair.run([to(mr, pair, 101, Opcode.RDMA_WRITE, [(0, 4096)], 0)])
    assert statuses(wcs) == [WcStatus.REM_ACCESS_ERR]
    assert np.array_equal(shared, before)


def test_an_allocation_revoked_while_its_fd_was_on_the_way_is_not_kept_mapped(
    pairs: PairFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The target deregisters the allocation's only region after it sent the fd, before the initiator
    mapped it: the mapping is dropped at once (no live region needs it; no later revocation would come
    to drop it), and the write is refused with nothing moved."""
    pair = pairs(1 << 20, 1 << 20)
    mr, shared = shared_region(pair, 1 << 20)
    qp = pair.a.qp
    assert isinstance(qp, CmaQueuePair) and qp.link is not None
    link = qp.link
    real = link.fetch

    def fetch_then_revoke(alloc_id: int, timeout: float) -> tuple[int, int] | None:
        got = real(alloc_id, timeout)
        pair.b.deregister(mr)  # returns once this initiator acknowledged the revocation
        return got

    monkeypatch.setattr(link, "fetch", fetch_then_revoke)
    pair.a.buf[:] = 0xCD
    before = shared.copy()
    wcs = pair.run([to(mr, pair, 0, Opcode.RDMA_WRITE, [(0, 4096)], 0)])
    assert statuses(wcs) == [WcStatus.REM_ACCESS_ERR]
    assert not link.maps, "a mapping no live region needs was kept"
    assert np.array_equal(shared, before)


def test_one_batch_over_two_shared_allocations_reaches_the_last_byte_of_each(pairs: PairFactory) -> None:
    """Requests naming two shared allocations in one batch (checked together, not under one key), each
    ending exactly at its allocation's end, move through the mappings; one byte further fails."""
    pair = pairs(1 << 20, 1 << 20)
    n, end = 4096, 1 << 20
    first, one = shared_region(pair, end)
    second, two = shared_region(pair, end)
    pair.a.buf[:] = random_bytes(1 << 20, 13)
    wrs = [
        to(first, pair, 0, Opcode.RDMA_WRITE, [(0, n)], end - n),
        to(second, pair, 1, Opcode.RDMA_WRITE, [(n, n)], end - n),
    ]
    assert all(wc.ok for wc in pair.run(wrs))
    assert np.array_equal(one[end - n :], pair.a.buf[:n]) and np.array_equal(two[end - n :], pair.a.buf[n : 2 * n])
    reads = [
        to(first, pair, 2, Opcode.RDMA_READ, [(2 * n, n)], end - n),
        to(second, pair, 3, Opcode.RDMA_READ, [(3 * n, n)], end - n),
    ]
    assert all(wc.ok for wc in pair.run(reads))
    assert np.array_equal(pair.a.buf[2 * n : 4 * n], pair.a.buf[: 2 * n])
    over = [
        to(first, pair, 4, Opcode.RDMA_WRITE, [(0, n)], end - n),
        to(second, pair, 5, Opcode.RDMA_WRITE, [(0, n)], end - n + 1),
    ]
    assert statuses(pair.run(over, expect=2)) == [WcStatus.SUCCESS, WcStatus.REM_ACCESS_ERR]


def test_windows_split_over_threads_are_byte_identical(pairs: PairFactory) -> None:
    pair = pairs(8 << 20, 8 << 20, specific=CmaOptions(threads=3, round_bytes=64 << 10, split_bytes=4096))
    src = random_bytes(4 << 20, 3)
    pair.a.buf[: 4 << 20] = src
    big = pair.write(0, 0, 3 << 20, 1 << 20)
    small = [pair.wr(1 + i, Opcode.RDMA_WRITE, [(i * 7919, 333), (i * 7919 + 4000, 2222)], (5 << 20) + i * 2555)
             for i in range(200)]  # fmt: skip
    assert all(wc.ok for wc in pair.run([big, *small]))
    assert np.array_equal(pair.b.buf[1 << 20 : 4 << 20], src[: 3 << 20])
    for i in range(200):
        got = pair.b.buf[(5 << 20) + i * 2555 : (5 << 20) + i * 2555 + 2555]
        assert np.array_equal(
            got, np.concatenate([src[i * 7919 : i * 7919 + 333], src[i * 7919 + 4000 : i * 7919 + 6222]])
        )
    pair.a.buf[:] = 0
    assert all(wc.ok for wc in pair.run([pair.read(300, 0, 3 << 20, 1 << 20)]))
    assert np.array_equal(pair.a.buf[: 3 << 20], src[: 3 << 20])


def test_iovec_windows_and_segments_cover_the_stream(backend_name: str) -> None:
    rng = np.random.default_rng(5)
    for _ in range(50):
        n, m = int(rng.integers(1, 20)), int(rng.integers(1, 20))
        total = int(rng.integers(2, 10000))
        cuts_a = (
            np.sort(rng.choice(np.arange(1, total), size=min(n - 1, total - 1), replace=False)) if total > 1 else []
        )
        cuts_b = (
            np.sort(rng.choice(np.arange(1, total), size=min(m - 1, total - 1), replace=False)) if total > 1 else []
        )
        la = np.diff([0, *cuts_a, total]).astype(np.uint64)
        lb = np.diff([0, *cuts_b, total]).astype(np.uint64)
        a = np.stack([np.cumsum(la) - la + 10_000, la], axis=1).astype(np.uint64)  # byte i at 10_000 + i
        b = np.stack([np.cumsum(lb) - lb + 90_000, lb], axis=1).astype(np.uint64)  # byte i at 90_000 + i
        start = int(rng.integers(0, total))
        stop = int(rng.integers(start + 1, total + 1))
        wa, wb = window(a, start, stop), window(b, start, stop)
        assert int(wa[:, 1].sum()) == int(wb[:, 1].sum()) == stop - start
        assert int(wa[0, 0]) == 10_000 + start and int(wb[0, 0]) == 90_000 + start
        for la_, lb_, k in zip(*segments(wa, wb), strict=True):
            assert la_ - 10_000 == lb_ - 90_000 and k > 0  # the same stream offset on both sides


def test_bad_settings_are_refused_with_the_key_named(backend_name: str) -> None:
    for bad in ({"threads": 0}, {"round_bytes": "4M"}, {"ptracer": "everyone"}, {"revoke_wait": 0}):
        with pytest.raises(InvalidArgument, match=rf"CmaOptions\.{next(iter(bad))}"):
            CmaOptions(**bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=r"BackendOptions\.specific must be a CmaOptions"):
        open_backend("cma", make_options(specific=TcpOptions()))
    backend = cma(open_backend("cma", make_options()))
    try:
        with pytest.raises(InvalidArgument, match="allocation size"):
            backend.allocate_buffer(0)
    finally:
        backend.close()


def spawn(*args: str) -> subprocess.Popen[str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.Popen(
        [sys.executable, "-m", "tests.backends.cma_peer", *args], cwd=ROOT, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip


def line(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    assert select.select([proc.stdout], [], [], 60)[0], "the helper process did not answer"
    got: dict[str, Any] = json.loads(proc.stdout.readline())
    return got


def tell(proc: subprocess.Popen[str], obj: object) -> None:
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(obj) + "\n")
    proc.stdin.flush()


def test_a_target_killed_mid_batch_on_shared_memory_fails_retry_exc_then_flushes(backend_name: str) -> None:
    opts = make_options(sq_depth=32)
    backend = open_backend(backend_name, opts)
    cq = backend.create_cq(4096)
    qp = backend.create_qp(cq)
    buf = np.ones(8 << 20, np.uint8)
    mr = backend.register_memory(memoryview(buf), Access.all())
    proc = spawn("target", str(8 << 20), "--shared")
    try:
        tell(proc, dict(qp.endpoint()))
        peer = line(proc)
        qp.connect(peer["endpoint"])
        chunk, slots = 256 << 10, 32

        def wr(i: int) -> WorkRequest:
            off = (i % slots) * chunk
            return WorkRequest(i, Opcode.RDMA_WRITE, (Sge(mr.addr + off, chunk, mr.lkey),), peer["addr"] + off,
                               peer["rkey"])  # fmt: skip

        waiter = CqWaiter(cq)
        wcs: list[WorkCompletion] = []
        posted, killed = 0, False
        while not any(not wc.ok for wc in wcs) or len(wcs) < posted:
            if not any(not wc.ok for wc in wcs):
                room = qp.max_send_wr - (posted - len(wcs))
                if room:
                    qp.post_send([wr(posted + i) for i in range(room)])
                    posted += room
            if not killed and len(wcs) >= 40:
                proc.send_signal(signal.SIGKILL)
                killed = True
            wcs += waiter.wait_some(timeout=WAIT)
        assert killed
        assert_peer_lost(wcs, posted, backend_name)
        assert qp.state == QpState.ERR
        assert wr_ids(wcs) == list(range(posted))
    finally:
        proc.kill()
        proc.communicate()
        qp.close()
        cq.close()
        backend.deregister_memory(mr)
        backend.close()


def test_a_write_to_a_target_that_exited_fails_before_the_reader_saw_the_end(
    backend_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Into shared memory this pair has mapped, a write to a target that is gone would land in pages no
    process reads; each window asks the target's pidfd first, so it fails RETRY_EXC_ERR (PEER_EXITED)
    even while the reader has not yet seen the connection end (held back here)."""
    hold_back_the_end(monkeypatch, 3.0)
    backend = open_backend(backend_name, make_options(sq_depth=32))
    cq = backend.create_cq(64)
    qp = backend.create_qp(cq)
    buf = np.ones(1 << 20, np.uint8)
    mr = backend.register_memory(memoryview(buf), Access.all())
    proc = spawn("target", str(1 << 20), "--shared")
    try:
        tell(proc, dict(qp.endpoint()))
        peer = line(proc)
        qp.connect(peer["endpoint"])
        waiter = CqWaiter(cq)

        def write(wr_id: int) -> WorkCompletion:
            qp.post_send([WorkRequest(wr_id, Opcode.RDMA_WRITE, (Sge(mr.addr, 4096, mr.lkey),), peer["addr"],
                                      peer["rkey"])])  # fmt: skip
            [wc] = waiter.wait(1)
            return wc

        assert write(0).status is WcStatus.SUCCESS  # the allocation is mapped here now
        proc.kill()
        proc.wait()
        wc = write(1)
        assert (wc.status, wc.vendor_err) == (WcStatus.RETRY_EXC_ERR, VendorErr.PEER_EXITED)
    finally:
        proc.kill()
        proc.communicate()
        qp.close()
        cq.close()
        backend.deregister_memory(mr)
        backend.close()


def test_a_target_the_kernel_will_not_let_us_attach_to_fails_the_connect_with_one_clear_line(backend_name: str) -> None:
    target = spawn("target", str(1 << 20), "--undumpable")
    initiator = spawn("initiator")
    try:
        tell(target, line(initiator)["endpoint"])
        tell(initiator, line(target)["endpoint"])
        result = line(initiator)
    finally:
        for proc in (initiator, target):
            proc.kill()
        _out, err = initiator.communicate()
        target.communicate()
    assert result["ok"] is False
    assert result["type"] == "CmaNotPermitted"
    assert "cross-memory attach to pid" in result["message"] and "EPERM" in result["message"]
    lines = [ln for ln in err.splitlines() if ln.startswith("cma:")]
    assert len(lines) == 1 and "fix:" in lines[0], err


def test_doctor_says_why_another_process_may_not_attach(backend_name: str) -> None:
    proc = spawn("doctor")
    try:
        result = line(proc)
    finally:
        proc.kill()
        proc.communicate()
    assert result["works"] is False, result
    failures = [ln for ln in result["lines"] if ln.startswith("FAIL")]
    assert len(failures) == 1 and "EPERM" in failures[0] and "fix:" in failures[0], result["lines"]


class FakeInitiator:
    """An initiator written by hand against the wire (``wire.py``): it can misbehave."""

    def __init__(self, backend: CmaBackend) -> None:
        self.qp = backend.create_qp(backend.create_cq(64))
        self.qp.connect({"backend": "cma", "accepting": False})  # the passive side: waits for a dial
        endpoint = self.qp.endpoint()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(WAIT)
        self.sock.connect("\0" + str(endpoint["socket"]))
        token = bytes.fromhex(str(endpoint["token"]))
        wire.send(self.sock, wire.HELLO.pack(wire.MAGIC, wire.Kind.HELLO, 0, wire.VERSION, token, 1, os.getpid(), 0))
        data, fd = wire.receive(self.sock, want_fd=True)
        assert fd is not None and len(data) == wire.WELCOME.size
        os.close(fd)
        self.inuse = InUse()
        wire.send(self.sock, self.msg(wire.Kind.READY), self.inuse.fd)
        assert wire.MSG.unpack(wire.receive(self.sock)[0])[1] == wire.Kind.ESTABLISHED
        # The target answers a request only once it has taken the connection as an initiator's.
        wire.send(self.sock, self.msg(wire.Kind.NEED, 12345))
        assert wire.MSG.unpack(wire.receive(self.sock)[0])[1] == wire.Kind.FD

    @staticmethod
    def msg(kind: int, a: int = 0) -> bytes:
        return wire.MSG.pack(wire.MAGIC, kind, 0, wire.VERSION, a, 0, 0)

    def close(self) -> None:
        self.sock.close()
        self.inuse.close()
        self.qp.close()


def test_deregistration_waits_only_for_a_window_in_progress_and_cuts_off_one_that_never_ends(
    backend_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    backend = cma(open_backend("cma", make_options(specific=CmaOptions(revoke_wait=0.3))))
    buf = np.zeros(1 << 20, np.uint8)
    fake = FakeInitiator(backend)
    try:
        # An initiator between windows: deregistration returns at once, then the revocation
        # arrives; its ack frees the slot.
        mr = backend.register_memory(memoryview(buf), Access.all())
        started = time.monotonic()
        backend.deregister_memory(mr)
        assert time.monotonic() - started < 0.25
        _m, kind, _s, _v, rkey, _b, _c = wire.MSG.unpack(wire.receive(fake.sock)[0])
        assert (kind, rkey) == (wire.Kind.REVOKE, mr.rkey)
        wire.send(fake.sock, fake.msg(wire.Kind.ACK, rkey))
        assert eventually(lambda: int(backend.table.records["rkey"][mr.rkey & SLOT_MASK]) == 0)
        # An initiator that announces a window over every slot and never ends it: the wait is
        # bounded by revoke_wait, one WARNING says so, and that initiator is cut off.
        mr = backend.register_memory(memoryview(buf), Access.all())
        fake.inuse.enter(ANY)
        started = time.monotonic()
        with caplog.at_level("WARNING", logger="moriio_async.cma"):
            backend.deregister_memory(mr)
        waited = time.monotonic() - started
        assert 0.25 <= waited < 0.3 + 2.0, waited
        assert [r.message for r in caplog.records if "revoke_wait" in r.message], caplog.text
        with pytest.raises((wire.ProtocolError, OSError)):
            while True:  # drain the revocation; then the end of the connection
                wire.receive(fake.sock)
        assert eventually(lambda: fake.qp.state == QpState.ERR)
    finally:
        fake.close()
        backend.close()


def test_an_idle_pair_whose_target_closed_stays_ready_and_its_next_request_fails_retry_exc(
    pairs: PairFactory,
) -> None:
    """As on a wire: with nothing outstanding, the end of the target's pair fails nothing; the next request
    fails RETRY_EXC_ERR naming the closed peer, and moves no byte."""
    pair = pairs(1 << 20, 1 << 20)
    qp = pair.a.qp
    assert isinstance(qp, CmaQueuePair) and qp.link is not None
    link = qp.link
    pair.b.qp.close()
    assert eventually(lambda: link.gone)
    assert qp.state == QpState.RTS
    pair.a.buf[:] = 0xEF
    before = pair.b.buf.copy()
    [wc] = pair.run([pair.write(0, 0, 4096, 0)])
    assert (wc.status, wc.vendor_err) == (WcStatus.RETRY_EXC_ERR, VendorErr.PEER_CLOSED)
    assert np.array_equal(pair.b.buf, before)


def test_a_pair_moved_to_error_during_a_window_reports_its_request_once_as_flushed(
    pairs: PairFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``to_error`` waits for the window being copied, then flushes the request; the worker, back from
    that copy, finds the pair in ERR and reports nothing more for it (no second completion, no error)."""
    entered, release = threading.Event(), threading.Event()
    real = Mover.move

    def held(self: Mover, *args: Any) -> tuple[int, int]:
        entered.set()
        release.wait(WAIT)
        return real(self, *args)

    monkeypatch.setattr(Mover, "move", held)
    pair = pairs(4 << 20, 4 << 20, specific=CmaOptions(inline_bytes=0))  # the worker executes, not the poster
    pair.a.qp.post_send([pair.write(0, 0, 2 << 20, 0)])
    assert entered.wait(WAIT)
    threading.Timer(0.2, release.set).start()  # to_error below waits for this copy
    with caplog.at_level(logging.ERROR, logger="moriio_async"):
        pair.a.qp.to_error()
        [wc] = pair.waiter.wait(1)
        assert (wc.wr_id, wc.status) == (0, WcStatus.WR_FLUSH_ERR)
        pair.waiter.expect_none()
    assert not caplog.records, caplog.text


def test_deregistering_a_local_region_returns_only_after_the_copy_out_of_it_ended(
    pairs: PairFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write's window reads this backend's region right now: its deregistration waits for that copy
    (the application may free the memory once it returns)."""
    entered, release = threading.Event(), threading.Event()
    real = Mover.move

    def held(self: Mover, *args: Any) -> tuple[int, int]:
        entered.set()
        release.wait(WAIT)
        return real(self, *args)

    monkeypatch.setattr(Mover, "move", held)
    pair = pairs(4 << 20, 4 << 20, specific=CmaOptions(inline_bytes=0))
    pair.a.qp.post_send([pair.write(0, 0, 2 << 20, 0)])
    assert entered.wait(WAIT)
    threading.Timer(0.2, release.set).start()
    pair.a.deregister(pair.a.mr)
    assert release.is_set(), "the deregistration returned while a copy out of the region went on"
    [wc] = pair.waiter.wait(1)
    assert wc.status is WcStatus.SUCCESS  # the copy had begun: it ends as it went


def test_a_bad_message_ends_only_its_own_connection(pairs: PairFactory) -> None:
    pair = pairs()
    fake = FakeInitiator(cma(pair.b.backend))
    try:
        fake.sock.send(b"\x00" * 5)
        with pytest.raises((wire.ProtocolError, OSError)):
            wire.receive(fake.sock)
        assert eventually(lambda: fake.qp.state == QpState.ERR)
        wcs = pair.run([pair.read(0, 0, 4096, 0)])  # the real initiator's pair still works
        assert statuses(wcs) == [WcStatus.SUCCESS]
        assert np.array_equal(pair.a.buf[:4096], pair.b.buf[:4096])
    finally:
        fake.close()


@pytest.mark.parametrize("opcode", [Opcode.RDMA_WRITE, Opcode.RDMA_READ])
def test_a_region_is_reachable_only_once_exported(pairs: PairFactory, opcode: Opcode) -> None:
    """As on tcp: a peer's request for a registered but unexported region is refused and touches nothing."""
    pair = pairs(1 << 20, 1 << 20)
    hidden = pair.b.register(pair.b.buf, Access.all(), export=False)
    pair.a.buf[:] = 0xCD
    before_a, before_b = pair.a.buf.copy(), pair.b.buf.copy()
    wcs = pair.run([to(hidden, pair, 0, opcode, [(0, 4096)], 0)], expect=1)
    assert statuses(wcs) == [WcStatus.REM_ACCESS_ERR]
    assert np.array_equal(pair.a.buf, before_a) and np.array_equal(pair.b.buf, before_b)
    pair.b.backend.export_memory(hidden)
    again = pairs(1 << 20, 1 << 20)
    shown = again.b.register(again.b.buf, Access.all(), export=False)
    again.b.backend.export_memory(shown)
    assert all(wc.ok for wc in again.run([to(shown, again, 0, opcode, [(0, 4096)], 0)]))
