"""The TCP backend's posting fast path: the doorbell's write outside the pair lock, and the
non-blocking calls that keep the GIL (``iov.HeldIo``)."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from moriio_async.backends.tcp import TcpQueuePair, iov
from moriio_async.status import WcStatus

from .harness import PairFactory, statuses

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.only_backends("tcp", reason="tests the TCP backend's doorbell and its socket calls"),
]


def test_held_send_and_recv_move_a_header_and_blocks_in_order() -> None:
    rng = np.random.default_rng(11)
    src = rng.integers(0, 256, 3000, dtype=np.uint8)
    dst = np.zeros(40 + 3000, dtype=np.uint8)
    base, out = int(src.ctypes.data), int(dst.ctypes.data)
    head = bytes(range(40))
    held = iov.HeldIo()
    a, b = socket.socketpair()
    with a, b:
        assert held.recv(b.fileno(), [(out, 10)]) == -1  # nothing there: -1, never a wait
        sent = held.send(a.fileno(), head, [(base + 1000, 2000), (base, 1000)])
        assert sent == 40 + 3000
        got = held.recv(b.fileno(), [(out, 40), (out + 40, 1000), (out + 1040, 2000)])
        assert got == 40 + 3000
        assert bytes(dst[:40]) == head
        assert np.array_equal(dst[40:], np.concatenate([src[1000:], src[:1000]]))
        assert held.send(a.fileno(), head[:8], []) == 8  # a header alone: one send(2)
        a.shutdown(socket.SHUT_WR)
        assert held.recv(b.fileno(), [(out, 8)]) == 8
        assert held.recv(b.fileno(), [(out, 8)]) == 0  # the end of the stream is 0, not -1


def test_held_send_takes_what_fits_and_never_blocks() -> None:
    src = np.ones(1 << 20, dtype=np.uint8)
    a, b = socket.socketpair()
    with a, b:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        held = iov.HeldIo()
        first = held.send(a.fileno(), b"h" * 16, [(int(src.ctypes.data), len(src))])
        assert 0 < first < len(src)  # a partial write, at once
        assert held.send(a.fileno(), b"h" * 16, [(int(src.ctypes.data), len(src))]) == -1  # full: -1
    with pytest.raises(OSError, match="Bad file descriptor"):
        held.send(a.fileno(), b"h", [])  # a closed fd is an error, not "nothing moved"


def test_the_doorbell_writes_the_socket_without_the_pair_lock(
    pairs: PairFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A post's own socket write runs under tx_lock only: the receiver, which completes responses
    under the pair lock, never waits for it."""
    from moriio_async.backends.tcp import qp, sender
    from moriio_async.backends.tcp.pairstate import PairState

    seen: list[tuple[bool, bool]] = []

    def watching(st: PairState, sock: socket.socket, rnd: sender.Round) -> None:
        seen.append((st.lock.locked(), st.tx_lock.locked()))
        sender.ring(st, sock, rnd)

    monkeypatch.setattr(qp, "ring", watching)
    pair = pairs()
    assert isinstance(pair.a.qp, TcpQueuePair)
    n = 6
    for i in range(n):  # one at a time: each post finds the sender idle and rings itself
        wr = pair.write(i, i * 4096, 4096, i * 4096) if i % 2 else pair.read(i, i * 4096, 4096, i * 4096)
        assert statuses(pair.run([wr])) == [WcStatus.SUCCESS]
    assert len(seen) == n
    assert seen == [(False, True)] * n


def test_the_receiver_keeps_the_gil_only_while_no_write_is_on_the_socket(
    pairs: PairFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A receive that keeps the GIL would sleep for the socket's lock while the sender's sendmsg
    holds it, stopping every thread of the process (pairstate.py's lock rules). In a stream of
    1 MiB WRITEs the responses come back while later rounds are being written: the receiver takes
    those with the GIL released, and keeps it again once the socket is quiet."""
    from moriio_async.backends.tcp.pairstate import PairState

    pair = pairs(size_a=16 << 20, size_b=16 << 20)
    st = pair.a.qp.pair_state
    assert isinstance(st, PairState)
    during_a_write: list[bool] = []
    real = iov.HeldIo.recv

    def watching(self: iov.HeldIo, fd: int, blocks: list[tuple[int, int]]) -> int:
        during_a_write.append(st.tx_lock.locked())
        return real(self, fd, blocks)

    monkeypatch.setattr(iov.HeldIo, "recv", watching)
    n = 96
    mib = 1 << 20
    for _ in range(2):
        wrs = [pair.write(i, (i % 16) * mib, mib, (i % 16) * mib) for i in range(n)]
        assert statuses(pair.run(wrs)) == [WcStatus.SUCCESS] * n
    # One may slip through: the sender can start a round between the check and the call (a GIL
    # switch in those few bytecodes). Without the check, most of the 192 responses come this way.
    assert during_a_write.count(True) <= 1
    quiet = len(during_a_write)
    for i in range(4):  # one at a time: nothing is being written when each response comes
        assert statuses(pair.run([pair.write(i, 0, 4096, 0)])) == [WcStatus.SUCCESS]
    assert len(during_a_write) > quiet and not any(during_a_write[quiet:])
