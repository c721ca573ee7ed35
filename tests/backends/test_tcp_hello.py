"""The TCP data port's hello, spoken by hand over real sockets (``backends/tcp/hello.py``): what a hello
that is not one gets back, that it claims nothing, and that a hello's bytes may come in pieces."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import msgspec
import pytest

from moriio_async.backends import open_backend
from moriio_async.backends.base import Backend, QueuePair
from moriio_async.backends.tcp import TcpOptions

from . import datawire as dw
from .harness import make_options

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.only_backends("tcp", reason="the TCP backend's data port, spoken by hand"),
]

BAD_HELLO, BAD_VERSION = 2, 3  # HelloStatus, as the wire documents it


@dataclass
class Port:
    backend: Backend
    port: int
    token: bytes
    qp_num: int
    qp: QueuePair

    @property
    def counters(self) -> dict[str, int]:
        return msgspec.structs.asdict(self.backend.describe().data_plane)


@contextmanager
def waiting_pair(**options: object) -> Iterator[Port]:
    """A backend whose one passive pair waits for the dial of the peer's pair number 100."""
    own = {k: options.pop(k) for k in list(options) if k in TcpOptions.__dataclass_fields__}
    backend = open_backend("tcp", make_options("tcp", **options, specific=TcpOptions(**own)))  # type: ignore[arg-type]
    try:
        qp = backend.create_qp(backend.create_cq(8))
        qp.bind_session(None, answering=True)
        qp.connect({"backend": "tcp", "accepting": False, "host": "127.0.0.1", "port": 1, "qp_num": 100})
        end = qp.endpoint()
        yield Port(backend, int(end["port"]), bytes.fromhex(str(end["token"])), int(end["qp_num"]), qp)
    finally:
        backend.close()


def answer(port: int, *parts: bytes) -> tuple[tuple[bytes, int, int, int], bytes]:
    """Send ``parts`` (a hello, in pieces) on a new connection: the hello-ack's fields and what follows it
    until the target closes (b"" when it closes right after the ack)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        for i, part in enumerate(parts):
            if i:
                time.sleep(0.05)  # most likely read apart (either way the answer must be the same)
            sock.sendall(part)
        magic, version, status, qp = dw.HELLO_ACK.unpack(dw.recv_exactly(sock, dw.HELLO_ACK.size))
        return (magic, version, status, qp), (sock.recv(64) if status != dw.OK else b"")


@pytest.mark.parametrize(
    ("magic", "version", "status", "why"),
    [
        (b"HTTP", dw.VERSION, BAD_HELLO, "not a moriio data-port hello"),
        (dw.MAGIC, dw.VERSION + 1, BAD_VERSION, f"wire version {dw.VERSION + 1}, this side {dw.VERSION}"),
    ],
    ids=["magic", "version"],
)
def test_a_hello_that_is_not_one_is_refused_with_why_and_claims_nothing(
    magic: bytes, version: int, status: int, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The refusal names what was wrong, on this side's magic and version, for pair number 0; the
    connection is closed; it is counted and logged with its source; and the waiting pair's token it
    carried is not used up (the checks come before the token is looked up), so the real dial gets in."""
    caplog.set_level(logging.WARNING, "moriio_async.tcp")
    with waiting_pair() as p:
        hello = dw.HELLO.pack(magic, version, 0, p.token, 7)
        ack, rest = answer(p.port, hello)
        assert ack == (dw.MAGIC, dw.VERSION, status, 0)
        assert rest == b"", "closed after the refusal"
        counts = p.counters
        assert (counts["bad_messages"], counts["refused_tokens"]) == (1, 0)
        lines = [r.getMessage() for r in caplog.records]
        assert lines == [f"tcp data port: bad message from 127.0.0.1: {why}"]
        sock, ok = dw.dial(p.port, p.token)
        with sock:
            assert ok == dw.OK


def test_a_hello_in_pieces_is_put_together_and_a_token_is_good_once() -> None:
    with waiting_pair() as p:
        hello = dw.hello_bytes(p.token)
        ack, _ = answer(p.port, hello[:1], hello[1:13], hello[13:])
        assert ack == (dw.MAGIC, dw.VERSION, dw.OK, p.qp_num), "the passive pair's own number in the ack"
        ack, rest = answer(p.port, hello)
        assert ack == (dw.MAGIC, dw.VERSION, dw.UNKNOWN_TOKEN, 0)
        assert rest == b""
        assert p.counters["refused_tokens"] == 1


def test_half_a_hello_is_cut_at_the_hello_deadline_logged_and_claims_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "moriio_async.tcp")
    with waiting_pair(hello_timeout=0.5) as p:
        with socket.create_connection(("127.0.0.1", p.port), timeout=10) as sock:
            sock.sendall(dw.hello_bytes(p.token)[:20])
            assert dw.closed_within(sock, 10.0), "cut at its 0.5 s deadline"
        assert p.counters["slow_messages"] == 1
        lines = [r.getMessage() for r in caplog.records]
        assert lines == ["tcp data port: 127.0.0.1: no whole hello within 0.5s; connection closed"]
        sock, ok = dw.dial(p.port, p.token)
        with sock:
            assert ok == dw.OK, "the token the cut hello carried is still good"


def test_connections_that_hang_up_in_their_hello_leave_the_hello_set() -> None:
    """Three connections hang up before their hello is whole, under a cap of two in their hello at once:
    each one closed leaves the set, so the real dial after them makes room for nobody."""
    with waiting_pair(max_data_hellos=2) as p:
        for _ in range(3):  # one after another, each gone before the next: none is evicted at another's accept
            with socket.create_connection(("127.0.0.1", p.port), timeout=10) as sock:
                sock.sendall(dw.hello_bytes(p.token)[:10])
                sock.shutdown(socket.SHUT_WR)
                assert dw.closed_within(sock, 10.0), "the target closed it once it saw it hang up"
        sock, ok = dw.dial(p.port, p.token)
        with sock:
            assert ok == dw.OK
        assert p.counters["evicted_hellos"] == 0, "a connection already gone was still in its hello"


def test_a_dial_for_a_pair_in_the_error_state_is_refused_as_an_unknown_token(caplog: pytest.LogCaptureFixture) -> None:
    """The pair went to the error state before its dial came (its token still expected, as until it
    closes): the dial is refused, logged with its source, counted, and closed."""
    caplog.set_level(logging.WARNING, "moriio_async.tcp")
    with waiting_pair() as p:
        p.qp.to_error()
        ack, rest = answer(p.port, dw.hello_bytes(p.token))
        assert ack == (dw.MAGIC, dw.VERSION, dw.UNKNOWN_TOKEN, 0)
        assert rest == b""
        assert p.counters["refused_tokens"] == 1
        lines = [r.getMessage() for r in caplog.records]
        assert lines == ["tcp data port: refused a connection from 127.0.0.1: unknown or used token"]
