"""A responder's resumable moves (``backends/tcp/pending.py``) on a real non-blocking socket pair: a move
says it is done only once every byte is in (or out), and resumes where it stopped."""

from __future__ import annotations

import itertools
import socket
from collections.abc import Iterator

import numpy as np
import pytest

from moriio_async.backends.tcp.iov import address, iovecs
from moriio_async.backends.tcp.pending import Pending

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.only_backends("tcp", reason="the TCP backend's socket moves"),
]


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.setblocking(False)
    with a, b:
        yield a, b


def two_blocks(blocks: list[np.ndarray]) -> Pending:
    iov = iovecs(len(blocks))
    for row, block in enumerate(blocks):
        iov[row] = (address(block), block.nbytes)
    return Pending(sum(b.nbytes for b in blocks), iov=iov, keep=blocks)


@pytest.mark.parametrize("kind", ["buffers", "iov"])
def test_a_receive_is_done_only_with_its_last_byte_and_resumes_where_it_stopped(
    kind: str, pair: tuple[socket.socket, socket.socket]
) -> None:
    a, b = pair
    blocks = [np.zeros(3, np.uint8), np.zeros(5, np.uint8)]
    flat = bytearray(8)
    pending = two_blocks(blocks) if kind == "iov" else Pending(8, [memoryview(flat)])
    b.sendall(b"abcd")
    assert pending.recv(a, 1) is False, "4 of 8 bytes in one call"
    assert pending.left == 4
    b.sendall(b"efg")
    assert pending.recv(a, 1) is False, "7 of 8: one byte still due when its calls ran out"
    assert pending.left == 1
    assert pending.recv(a) is False, "nothing more has come"
    b.sendall(b"h")
    assert pending.recv(a) is True
    assert pending.left == 0
    got = b"".join(x.tobytes() for x in blocks) if kind == "iov" else bytes(flat)
    assert got == b"abcdefgh"
    b.sendall(b"more")
    assert pending.recv(a) is True, "done: it takes no byte past its own"
    assert a.recv(8) == b"more"


def test_a_receive_raises_at_the_end_of_the_stream(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    pending = Pending(8, [memoryview(bytearray(8))])
    b.sendall(b"abc")
    b.shutdown(socket.SHUT_WR)
    with pytest.raises(EOFError):
        pending.recv(a)
    assert pending.left == 5


@pytest.mark.parametrize("kind", ["buffers", "iov"])
def test_a_send_on_a_full_socket_stops_and_resumes_and_sends_every_byte_once(
    kind: str, pair: tuple[socket.socket, socket.socket]
) -> None:
    a, b = pair
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    size = 1 << 20  # far more than the socket pair holds: the send stops on a full buffer
    data = (np.arange(size) % 253).astype(np.uint8)
    half = size // 2
    if kind == "iov":
        pending = two_blocks([data[:half], data[half:]])
    else:
        pending = Pending(size, [memoryview(data[:half]), memoryview(data[half:])])
    got = bytearray()
    b.settimeout(10)
    for rounds in itertools.count():
        if pending.send(a):
            break
        assert 0 < pending.left < size
        assert rounds < size, "it makes progress"
        got += b.recv(1 << 16)
    assert rounds > 1, "it stopped and resumed"
    while len(got) < size:
        got += b.recv(size - len(got))
    assert bytes(got) == data.tobytes(), "every byte once, in order"
    b.setblocking(False)
    with pytest.raises(BlockingIOError):
        b.recv(1)  # and nothing after them


class Stingy:
    """A socket that takes at most ``take`` bytes a call (as a busy kernel may), and keeps them."""

    def __init__(self, take: int) -> None:
        self.take = take
        self.sent = bytearray()

    def sendmsg(self, buffers: list[bytes | memoryview], _ancillary: object, _flags: int) -> int:
        out = b"".join(bytes(x) for x in buffers)[: self.take]
        self.sent += out
        return len(out)


def test_a_send_stopped_by_its_calls_one_byte_short_is_not_done() -> None:
    sock = Stingy(4)
    pending = Pending(5, [b"ab", b"cde"])
    assert pending.send(sock, 1) is False  # type: ignore[arg-type]
    assert (pending.left, bytes(sock.sent)) == (1, b"abcd")
    assert pending.send(sock, 1) is True  # type: ignore[arg-type]
    sock = Stingy(4)
    pending = Pending(5, [b"ab", b"cde"])
    assert pending.send(sock) is True, "as many calls as it takes"  # type: ignore[arg-type]
    assert bytes(sock.sent) == b"abcde", "every byte once"
