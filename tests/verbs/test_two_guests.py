"""Two guests, a real (emulated) wire between them: loss and link down mid-batch.

Runs only with ``tools/guest/run.py --guests 2`` (MORIIO_GUEST_COUNT=2). Both
guests run this file; role ``b`` serves a region and a queue pair, role ``a``
posts to it and breaks the wire under its own requests. Each test opens its
own TCP control connection (b listens, a connects) to swap endpoints, then
``a`` says "bye" when done so ``b`` closes its side only afterwards.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from moriio_async.backends import open_backend
from moriio_async.backends.base import Backend, CompletionQueue, QueuePair
from moriio_async.status import Access, WcStatus

from .conftest import drain, guest_options, write

ROLE = os.environ.get("MORIIO_GUEST_ROLE", "")
pytestmark = pytest.mark.skipif(
    os.environ.get("MORIIO_GUEST_COUNT") != "2", reason="needs two guests: tools/guest/run.py --guests 2"
)
PORT = 18515
NETDEV = "eth0"


def _lines(sock: socket.socket) -> Iterator[str]:
    buf = b""
    while True:
        while b"\n" not in buf:
            chunk = sock.recv(65536)
            if not chunk:
                return
            buf += chunk
        line, buf = buf.split(b"\n", 1)
        yield line.decode()


@contextmanager
def _control(index: int) -> Iterator[socket.socket]:
    port = PORT + index
    if ROLE == "b":
        with socket.create_server((os.environ["MORIIO_GUEST_SELF_IP"], port)) as server:
            server.settimeout(120)
            conn, _ = server.accept()
            with conn:
                conn.settimeout(120)
                yield conn
        return
    deadline = time.monotonic() + 120
    while True:
        try:
            sock = socket.create_connection((os.environ["MORIIO_GUEST_PEER_IP"], port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    with sock:
        sock.settimeout(120)
        yield sock


def _serve(index: int) -> None:
    """Role b: one region and one passive pair for a, until a says bye."""
    backend = open_backend("verbs", guest_options())
    try:
        buf = bytearray(8 << 20)
        region = backend.register_memory(memoryview(buf), Access.all())
        cq = backend.create_cq(256)
        qp = backend.create_qp(cq)
        with _control(index) as conn:
            lines = _lines(conn)
            qp.connect(json.loads(next(lines)))
            reply = {"endpoint": dict(qp.endpoint()), "addr": region.addr, "rkey": region.rkey}
            conn.sendall((json.dumps(reply) + "\n").encode())
            assert next(lines, "bye") == "bye"
    finally:
        backend.close()


def _connect(index: int, backend: Backend, conn: socket.socket) -> tuple[CompletionQueue, QueuePair, dict[str, int]]:
    cq = backend.create_cq(256)
    qp = backend.create_qp(cq)
    conn.sendall((json.dumps(dict(qp.endpoint())) + "\n").encode())
    peer = json.loads(next(_lines(conn)))
    qp.connect(peer["endpoint"])
    return cq, qp, peer


def _tc(*args: str) -> None:
    subprocess.run(["tc", "qdisc", *args], check=True)


def test_total_loss_mid_batch_gives_retry_exceeded_then_flushes() -> None:
    if ROLE == "b":
        _serve(0)
        return
    backend = open_backend("verbs", guest_options(qp_timeout=12, retry_cnt=3))
    try:
        src = backend.register_memory(memoryview(bytearray(os.urandom(1 << 20))), Access.all())
        with _control(0) as conn:
            cq, qp, peer = _connect(0, backend, conn)
            first = [write(i, src, peer["addr"] + i * 4096, peer["rkey"], 4096, signaled=i == 3) for i in range(4)]
            qp.post_send(first)
            assert [(w.wr_id, w.status) for w in drain(cq, 1, 30)] == [(3, WcStatus.SUCCESS)]
            _tc("add", "dev", NETDEV, "root", "netem", "loss", "100%")
            try:
                ids = list(range(4, 20))
                qp.post_send([write(i, src, peer["addr"] + i * 4096, peer["rkey"], 4096, signaled=False) for i in ids])
                started = time.monotonic()
                wcs = drain(cq, len(ids), 30)
                took = time.monotonic() - started
            finally:
                _tc("del", "dev", NETDEV, "root")
            conn.sendall(b"bye\n")
        print(f"two guests, 100% loss: {len(wcs)} completions in {took:.3f}s, first {wcs[0].status.name}")
        assert [w.wr_id for w in wcs] == ids
        assert wcs[0].status is WcStatus.RETRY_EXC_ERR, [w.status.name for w in wcs]
        assert all(w.status is WcStatus.WR_FLUSH_ERR for w in wcs[1:])
        assert took < 10  # 4 tries of ~17 ms, with a wide margin for emulation
    finally:
        backend.close()


def test_link_down_mid_batch_fails_at_once_over_the_wire() -> None:
    if ROLE == "b":
        _serve(1)
        return
    backend = open_backend("verbs", guest_options(qp_timeout=18, retry_cnt=6))
    try:
        src = backend.register_memory(memoryview(bytearray(1 << 20)), Access.all())
        with _control(1) as conn:
            cq, qp, peer = _connect(1, backend, conn)
            _tc("add", "dev", NETDEV, "root", "netem", "loss", "100%")  # keep the batch outstanding
            try:
                ids = list(range(16))
                qp.post_send([write(i, src, peer["addr"] + i * 4096, peer["rkey"], 4096, signaled=False) for i in ids])
                subprocess.run(["ip", "link", "set", "dev", NETDEV, "down"], check=True)
                started = time.monotonic()
                wcs = drain(cq, len(ids), 20)
                took = time.monotonic() - started
            finally:
                subprocess.run(["ip", "link", "set", "dev", NETDEV, "up"], check=True)
                _tc("del", "dev", NETDEV, "root")
            time.sleep(3)  # let the link and ARP settle before the control socket speaks again
            conn.sendall(b"bye\n")
        print(f"two guests, link down: {len(wcs)} completions in {took:.3f}s")
        assert [w.wr_id for w in wcs] == ids
        assert all(w.status is WcStatus.WR_FLUSH_ERR for w in wcs), [w.status.name for w in wcs]
        assert took < 1.0, "PORT_ERR did not fail the batch before the ~1 s ACK timeout"
    finally:
        backend.close()
