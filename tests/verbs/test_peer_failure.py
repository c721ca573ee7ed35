"""A peer that dies or a link that goes down mid-batch: every request ends, within a deadline, in order."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from moriio_async.backends import open_backend
from moriio_async.backends.base import Backend
from moriio_async.backends.verbs import probe
from moriio_async.status import Access, WcStatus
from moriio_async.work import WorkCompletion

from .conftest import connect, drain, guest_only, guest_options, write

pytestmark = guest_only

REPO = Path(__file__).resolve().parents[2]


def _assert_ordered_failure(wcs: list[WorkCompletion], ids: list[int], first: set[WcStatus]) -> None:
    got = [w.wr_id for w in wcs]
    assert got and got == ids[len(ids) - len(got) :], got  # a suffix: earlier ones were covered
    failed = [w for w in wcs if not w.ok]
    assert failed, "nothing failed"
    assert failed[0].status in first, [w.status.name for w in wcs]
    assert all(w.status is WcStatus.WR_FLUSH_ERR for w in failed[1:]), [w.status.name for w in wcs]


def test_peer_killed_mid_batch_gives_retry_exceeded_then_flushes() -> None:
    # qp_timeout 10 (~4 ms) and retry_cnt 2: a dead peer is declared within tens of milliseconds.
    backend: Backend = open_backend("verbs", guest_options(qp_timeout=10, retry_cnt=2))
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    child = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("peer.py"))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=path), text=True,
    )  # fmt: skip
    try:
        src_buf = bytearray(os.urandom(1 << 20))
        src = backend.register_memory(memoryview(src_buf), Access.all())
        cq = backend.create_cq(1024)
        qp = backend.create_qp(cq)
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(json.dumps(dict(qp.endpoint())) + "\n")
        child.stdin.flush()
        peer = json.loads(child.stdout.readline())
        qp.connect(peer["endpoint"])
        size = 64 << 10
        first = [write(i, src, peer["addr"] + i * size, peer["rkey"], size, signaled=i == 7) for i in range(8)]
        qp.post_send(first)
        assert [(w.wr_id, w.status) for w in drain(cq, 1, 10)] == [(7, WcStatus.SUCCESS)]
        # The peer dies mid-batch; the rest of the batch goes to a queue pair that no longer exists.
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        ids = list(range(8, 40))
        qp.post_send([write(i, src, peer["addr"] + (i % 64) * size, peer["rkey"], size, signaled=i == 39) for i in ids])
        started = time.monotonic()
        wcs = drain(cq, len(ids), 30)
        took = time.monotonic() - started
        assert wcs and wcs[-1].wr_id == ids[-1], f"the batch did not end within 30s: {len(wcs)} completions"
        first_error = next(w.status.name for w in wcs if not w.ok)
        print(f"peer killed: {len(wcs)} completions, first error {first_error}, all in {took:.3f}s")
        _assert_ordered_failure(wcs, ids, {WcStatus.RETRY_EXC_ERR})
        assert took < 10
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        for stream in (child.stdin, child.stdout):
            if stream is not None:
                stream.close()
        backend.close()


def _netdev(device: str) -> str:
    report = probe()
    for dev in report.devices:
        if dev.name == device and dev.netdevs:
            return dev.netdevs[0]
    raise AssertionError(f"no netdev for {device}: {report}")


def _port_active(device: str) -> bool:
    return any(d.name == device and any(p.active for p in d.ports) for d in probe().devices)


def test_link_down_mid_batch_fails_everything_at_once() -> None:
    """PORT_ERR reaches the event thread, which fails every pair: long before any retry timer."""
    device = os.environ.get("MORIIO_GUEST_DEVICE", "rxe0")
    netdev = _netdev(device)
    # qp_timeout 18 (~1.1 s per try, 7 tries): without the event the batch would hang ~8 s.
    backend = open_backend("verbs", guest_options(qp_timeout=18, retry_cnt=7))
    try:
        src_buf, dst_buf = bytearray(1 << 20), bytearray(1 << 20)
        src = backend.register_memory(memoryview(src_buf), Access.all())
        dst = backend.register_memory(memoryview(dst_buf), Access.all())
        cq = backend.create_cq(256)
        active, passive = connect(backend, cq)
        passive.to_error()  # the responder drops everything: requests stay outstanding (see test_real_verbs)
        ids = list(range(1, 33))
        active.post_send([write(i, src, dst.addr, dst.rkey, 4096, signaled=i == ids[-1]) for i in ids])
        assert drain(cq, 1, 0.3) == [], "requests completed although the responder is in ERR"
        subprocess.run(["ip", "link", "set", "dev", netdev, "down"], check=True)
        started = time.monotonic()
        try:
            wcs = drain(cq, len(ids), 20)
            took = time.monotonic() - started
        finally:
            subprocess.run(["ip", "link", "set", "dev", netdev, "up"], check=True)
            deadline = time.monotonic() + 20
            while not _port_active(device) and time.monotonic() < deadline:
                time.sleep(0.2)
        print(f"link down: {len(wcs)} completions in {took:.3f}s: {sorted({w.status.name for w in wcs})}")
        assert [w.wr_id for w in wcs] == ids
        _assert_ordered_failure(wcs, ids, {WcStatus.WR_FLUSH_ERR, WcStatus.FATAL_ERR})
        assert took < 1.0, f"the batch took {took:.3f}s to fail: the port event did not act"
        assert _port_active(device), "the port did not come back ACTIVE after the link went up"
    finally:
        backend.close()
