"""One accepted data connection's socket on the reactor (``connection.py``), driven by a test subclass
instead of the responder: the drain after a refusal, the linger after an aborted WRITE, and the chunk
deadline, which is one timer that re-arms when it fires before the deadline it finds.

``Chunks`` plays the responder's part in the smallest way: a chunk is ``CHUNK`` bytes, due within
one ``timeout`` from its first byte (the responder's rule), and the deadline is infinite between
chunks."""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from moriio_async.backends.tcp import VendorErr
from moriio_async.backends.tcp.connection import BUDGET, DRAIN, HEAD, LINGER, PAYLOAD, SENDING, Connection
from moriio_async.backends.tcp.iov import MIN_RATE
from moriio_async.backends.tcp.pending import Pending
from moriio_async.backends.tcp.reactor import IN, Reactor

from . import datawire as dw

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.only_backends("tcp", reason="the TCP backend's connection, on a reactor"),
]

CHUNK = 4
ENDS = 10.0  # how long a test waits for an end it expects: far beyond any timeout below
MIB = 1 << 20


class Chunks(Connection):
    """A connection whose chunks are ``CHUNK`` bytes; records the chunks and how service ended."""

    def __init__(self, sock: socket.socket, timeout: float, reactor: Reactor) -> None:
        super().__init__(sock, timeout, reactor)
        self.buf = memoryview(bytearray(CHUNK))
        self.got = 0
        self.chunks: list[bytes] = []
        self.vendors: list[VendorErr | None] = []
        self.ended_at = 0.0
        self.gone = threading.Event()
        self.readies = 0

    def ready(self, events: int) -> None:
        self.readies += 1
        super().ready(events)

    def read_chunk(self) -> bool:
        n = self.recv(self.buf[self.got :])
        if n < 0:  # as the responder: a hang-up between chunks is no error
            self.shutdown(VendorErr.PEER_CLOSED if self.got else None)
            return False
        if not n:
            return self.wait(IN)
        if not self.got:
            self.deadline = time.monotonic() + self.timeout
        self.got += n
        if self.got == CHUNK:
            self.chunks.append(bytes(self.buf))
            self.got = 0
            self.deadline = float("inf")
        return True

    def next_chunk(self) -> None:
        self.phase = HEAD
        self.deadline = float("inf")

    def ended(self, vendor: VendorErr | None) -> None:
        self.vendors.append(vendor)
        self.ended_at = time.monotonic()
        self.gone.set()


@contextmanager
def served(timeout: float, *, tcp: bool = False) -> Iterator[tuple[Chunks, socket.socket, Reactor]]:
    """A ``Chunks`` connection watched by its own reactor, and the peer's end of its socket."""
    if tcp:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            peer = socket.create_connection(listener.getsockname())
            ours, _ = listener.accept()
    else:
        ours, peer = socket.socketpair()
    ours.setblocking(False)
    reactor = Reactor("test-reactor")
    connection = Chunks(ours, timeout, reactor)
    on_reactor(reactor, lambda: reactor.watch(connection.fd, connection, IN))
    try:
        with peer:
            yield connection, peer, reactor
    finally:
        reactor.stop(lambda: None)
        ours.close()


def on_reactor(reactor: Reactor, call: Callable[[], None]) -> None:
    """Run ``call`` on the reactor's thread and wait for it; what it raised is raised here."""
    done = threading.Event()
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as e:  # the reactor would only log it
            raised.append(e)
        finally:
            done.set()

    assert reactor.call_soon(run)
    assert done.wait(ENDS)
    if raised:
        raise raised[0]


def until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + ENDS
    while not condition():
        assert time.monotonic() < deadline, "the connection never got there"
        time.sleep(0.005)


def send_all_within(peer: socket.socket, data: bytes) -> None:
    """Send ``data``, which is more than the socket buffers hold: only a target reading it lets it all go."""
    peer.settimeout(ENDS)
    peer.sendall(data)


# -- the drain after a refusal ------------------------------------------------------------------------


def refuse(connection: Connection) -> None:
    connection.refuse_rest()
    connection.pump()


def test_a_refusal_sends_the_end_of_the_stream_and_executes_nothing_more() -> None:
    with served(30.0) as (connection, peer, reactor):
        peer.sendall(b"abcd")
        until(lambda: connection.chunks == [b"abcd"])
        on_reactor(reactor, lambda: refuse(connection))
        peer.settimeout(ENDS)
        assert peer.recv(16) == b"", "the target did not end its stream after the refusal"
        peer.sendall(b"efghijkl")  # two more whole chunks: drained, never served
        time.sleep(0.1)
        assert connection.chunks == [b"abcd"]
        assert connection.phase == DRAIN
        assert not connection.gone.is_set()


def test_the_drain_takes_in_whatever_the_peer_still_sends_then_ends_when_it_hangs_up() -> None:
    with served(30.0) as (connection, peer, reactor):
        on_reactor(reactor, lambda: refuse(connection))
        send_all_within(peer, b"\7" * (8 * MIB))  # a pipelining initiator's payloads behind the refused one
        assert not connection.gone.is_set(), "the drain ended while the peer was still connected"
        peer.shutdown(socket.SHUT_WR)
        assert connection.gone.wait(ENDS), "the drain did not end when the peer hung up"
        assert connection.vendors == [None]  # the peer's hang-up is the expected end, not an error
        assert connection.chunks == []


def test_the_drain_of_a_silent_peer_gives_up_after_one_timeout() -> None:
    with served(0.3) as (connection, peer, reactor):
        started = time.monotonic()
        on_reactor(reactor, lambda: refuse(connection))
        assert connection.gone.wait(ENDS), "the drain waited for a silent peer forever"
        assert connection.ended_at - started >= 0.3
        # Not PEER_SILENT: the responder reports that one as a chunk that did not arrive in time.
        assert connection.vendors == [VendorErr.SEND_TIMEOUT]
        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            peer.sendall(b"\7" * MIB)  # closed: the peer is reset, not drained any more


def test_a_refusal_after_the_peer_reset_ends_service() -> None:
    """Ending its stream fails on a reset connection (ENOTCONN): the drain then finds it gone and ends."""
    with served(30.0, tcp=True) as (connection, peer, reactor):
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

        def reset_then_refuse() -> None:  # in one reactor call: the reset is not served as a read first
            peer.close()
            time.sleep(0.1)  # the reset crosses loopback
            refuse(connection)

        on_reactor(reactor, reset_then_refuse)
        assert connection.gone.wait(ENDS), "a refusal on a reset connection never ended"
        assert connection.vendors == [None]


def test_a_peer_that_keeps_sending_does_not_keep_the_drain() -> None:
    with served(0.3) as (connection, peer, reactor):
        stop = threading.Event()

        def keep_sending() -> None:
            with contextlib.suppress(OSError):
                while not stop.is_set():
                    peer.send(b"\7" * 4096)

        sender = threading.Thread(target=keep_sending, daemon=True)
        started = time.monotonic()
        on_reactor(reactor, lambda: refuse(connection))
        sender.start()
        try:
            assert connection.gone.wait(ENDS), "a peer that keeps sending kept the connection"
            assert connection.ended_at - started >= 0.3
            assert connection.vendors == [VendorErr.SEND_TIMEOUT]
        finally:
            stop.set()
            with contextlib.suppress(OSError):
                peer.shutdown(socket.SHUT_RDWR)
            sender.join(ENDS)


# -- the linger after an aborted WRITE -------------------------------------------------------------------


def abort_and_linger(connection: Connection) -> None:
    """What the responder does after answering an aborted WRITE: the abort shut the read side."""
    connection.sock.shutdown(socket.SHUT_RD)
    connection.linger()
    connection.pump()  # the answer's send goes on to its next step, as in the responder


def test_the_linger_takes_in_what_the_peer_sends_and_ends_when_it_hangs_up() -> None:
    with served(30.0, tcp=True) as (connection, peer, reactor):
        on_reactor(reactor, lambda: abort_and_linger(connection))
        send_all_within(peer, b"\7" * (8 * MIB))  # the payloads behind the aborted WRITE: no reset
        assert connection.phase == LINGER
        assert not connection.gone.is_set(), "the linger ended while the peer was still connected"
        assert not dw.closed_within(peer, 0.2), "the linger ended the target's stream: Linux resets on data then"
        peer.shutdown(socket.SHUT_WR)
        assert connection.gone.wait(ENDS), "the linger did not end when the peer hung up"
        assert connection.vendors == [None]


def test_a_lingering_connection_is_not_served_readiness_but_polls_on_its_timer() -> None:
    """Its read-shut socket is always readable: watched for it, the reactor would spin on it."""
    with served(30.0, tcp=True) as (connection, _peer, reactor):
        on_reactor(reactor, lambda: abort_and_linger(connection))
        before = connection.readies
        time.sleep(0.2)
        assert connection.readies == before
        assert connection.phase == LINGER


def test_the_linger_ends_when_the_peer_hangs_up_without_sending() -> None:
    with served(30.0, tcp=True) as (connection, peer, reactor):
        on_reactor(reactor, lambda: abort_and_linger(connection))
        time.sleep(0.05)  # a few of its polls find the peer still there
        assert not connection.gone.is_set()
        peer.shutdown(socket.SHUT_WR)
        assert connection.gone.wait(ENDS), "the linger did not see the peer's hang-up"
        assert connection.vendors == [None]


def test_the_linger_gives_up_after_one_timeout_when_the_peer_stays() -> None:
    with served(0.3, tcp=True) as (connection, _peer, reactor):
        started = time.monotonic()
        on_reactor(reactor, lambda: abort_and_linger(connection))
        assert connection.gone.wait(ENDS), "the linger waited for a peer that stays forever"
        assert connection.ended_at - started >= 0.3
        assert connection.vendors == [None]


def test_a_stop_ends_the_linger() -> None:
    with served(30.0, tcp=True) as (connection, _peer, reactor):
        on_reactor(reactor, lambda: abort_and_linger(connection))
        connection.stop()
        assert connection.gone.wait(ENDS), "the linger outlived the stop"
        assert connection.stopped


def test_a_stop_from_another_thread_ends_service_and_join_waits_for_it(caplog: pytest.LogCaptureFixture) -> None:
    with served(30.0) as (connection, peer, reactor):
        on_reactor(reactor, connection.join)  # on the reactor's own thread: no wait for itself
        assert not connection.gone.is_set()
        connection.stop()
        connection.join()
        assert connection.gone.is_set()
        assert connection.stopped
        assert connection.vendors == [None]
        peer.settimeout(ENDS)
        assert peer.recv(16) == b""
        on_reactor(reactor, lambda: None)  # after what stop queued: its turn is over, anything logged is in
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "a stop logged an error"


def test_a_reset_between_chunks_is_the_end_of_the_stream_not_data() -> None:
    with served(30.0, tcp=True) as (connection, peer, _reactor):
        peer.sendall(b"abcd")
        until(lambda: connection.chunks == [b"abcd"])
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        peer.close()  # a reset: the connection's read raises ECONNRESET
        assert connection.gone.wait(ENDS)
        assert connection.vendors == [None], "the reset was read as the first byte of a chunk"
        assert connection.chunks == [b"abcd"]


def test_a_backlog_past_the_budget_is_served_at_the_next_turns(caplog: pytest.LogCaptureFixture) -> None:
    with served(30.0) as (connection, peer, _reactor):
        backlog = [bytes([65 + i % 26]) * CHUNK for i in range(3 * BUDGET)]  # one socket call each
        peer.sendall(b"".join(backlog))
        until(lambda: len(connection.chunks) == len(backlog))
        assert connection.chunks == backlog
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


# -- the chunk deadline ---------------------------------------------------------------------------------


def test_a_chunk_that_does_not_arrive_whole_in_time_ends_service_as_a_silent_peer() -> None:
    with served(0.3) as (connection, peer, _reactor):
        sent = time.monotonic()
        peer.sendall(b"ab")
        assert connection.gone.wait(ENDS), "a chunk left half-sent held the connection forever"
        assert connection.ended_at - sent >= 0.3
        assert connection.vendors == [VendorErr.PEER_SILENT]


def test_an_idle_connection_between_chunks_is_not_timed_out() -> None:
    with served(0.1) as (connection, peer, _reactor):
        peer.sendall(b"a")
        until(lambda: connection.got == 1)  # the chunk's deadline is armed while it waits for the rest
        peer.sendall(b"bcd")
        until(lambda: connection.chunks == [b"abcd"])
        time.sleep(0.4)  # past the first chunk's deadline: its timer fires and finds none
        assert not connection.gone.is_set()
        peer.sendall(b"efgh")
        until(lambda: connection.chunks == [b"abcd", b"efgh"])
        assert connection.phase == HEAD
        sent = time.monotonic()
        peer.sendall(b"i")  # and the next chunk still has its deadline: half-sent, it ends service
        assert connection.gone.wait(ENDS), "after an idle while, a half-sent chunk held the connection forever"
        assert connection.ended_at - sent >= 0.1
        assert connection.vendors == [VendorErr.PEER_SILENT]


def test_the_deadline_timer_of_a_finished_chunk_re_arms_for_the_next_chunk() -> None:
    """The first chunk's timer is still in the reactor's heap when the second chunk starts, with a later
    deadline: it must fire, find that deadline ahead, and wait for it, neither ending the second chunk
    early nor leaving it without a timer."""
    with served(0.5) as (connection, peer, _reactor):
        peer.sendall(b"a")
        until(lambda: connection.got == 1)  # the timer is armed at the first chunk's deadline
        peer.sendall(b"bcd")
        until(lambda: connection.chunks == [b"abcd"])
        time.sleep(0.2)
        second = time.monotonic()
        peer.sendall(b"e")  # the second chunk's first byte, then silence
        assert connection.gone.wait(ENDS), "the second chunk's deadline never fired"
        assert connection.ended_at - second >= 0.5, "the first chunk's timer ended the second chunk early"
        assert connection.vendors == [VendorErr.PEER_SILENT]


# -- a WRITE's payload, and an abort of the moves on a pinned region ----------------------------------------


ANSWER = b"answer"


class Payload:
    """A WRITE's payload of ``n`` bytes to receive into ``buf``; ``aborted`` records ``received``'s calls,
    each then answered with ``ANSWER`` before the next chunk (or, aborted, the linger), as the responder does."""

    def __init__(self, n: int) -> None:
        self.buf = bytearray(n)
        self.aborted: list[bool] = []
        self.called = threading.Event()
        self.connection: Chunks | None = None

    def received(self, aborted: bool) -> None:
        self.aborted.append(aborted)
        self.called.set()
        assert self.connection is not None
        then = self.connection.linger if aborted else self.connection.next_chunk
        self.connection.send(Pending(len(ANSWER), [ANSWER]), then)

    def start(self, connection: Chunks) -> None:
        """On the reactor: what the responder does once a WRITE chunk's regions are pinned."""
        self.connection = connection
        connection.moving_begins(True)
        connection.receive(Pending(len(self.buf), [memoryview(self.buf)]), self.received)
        connection.pump()


def test_a_payload_is_received_whole_then_reported_not_aborted() -> None:
    with served(30.0) as (connection, peer, reactor):
        payload = Payload(64 * 1024)
        on_reactor(reactor, lambda: payload.start(connection))
        assert connection.phase == PAYLOAD
        send_all_within(peer, b"\5" * len(payload.buf))
        assert payload.called.wait(ENDS)
        assert payload.aborted == [False]
        assert payload.buf == b"\5" * len(payload.buf)
        peer.settimeout(ENDS)
        assert peer.recv(16) == ANSWER
        peer.sendall(b"abcd")  # and the connection serves on
        until(lambda: connection.chunks == [b"abcd"])
        assert not connection.gone.is_set()


def test_receiving_a_payload_extends_the_chunk_deadline_by_its_time_at_min_rate() -> None:
    with served(30.0) as (connection, peer, reactor):
        payload = Payload(3 * MIN_RATE)
        peer.sendall(b"ab")  # a chunk under way: its deadline is set
        until(lambda: connection.got == 2)
        before = connection.deadline
        on_reactor(reactor, lambda: payload.start(connection))
        assert connection.deadline == before + 3.0


@pytest.mark.parametrize("hangs_up", ["shutdown", "close"])
def test_a_peer_that_hangs_up_mid_payload_ends_service_and_the_write_is_not_reported(hangs_up: str) -> None:
    """Also when the hang-up is reported as one (EPOLLHUP, a closed socket's): the payload's own read
    tells it from the end of a chunk."""
    with served(30.0) as (connection, peer, reactor):
        payload = Payload(4096)
        on_reactor(reactor, lambda: payload.start(connection))
        peer.sendall(b"\5" * 100)
        until(lambda: payload.buf[99] == 5)
        if hangs_up == "shutdown":
            peer.shutdown(socket.SHUT_WR)
        else:
            peer.close()
        assert connection.gone.wait(ENDS)
        assert connection.vendors == [VendorErr.PEER_CLOSED]
        assert payload.aborted == [], "a WRITE whose payload never came whole was reported received"


def test_an_abort_during_a_payload_ends_the_receive_as_aborted_and_keeps_the_connection_to_answer() -> None:
    with served(30.0, tcp=True) as (connection, peer, reactor):
        payload = Payload(4096)
        on_reactor(reactor, lambda: payload.start(connection))
        peer.sendall(b"\5" * 100)
        connection.abort()  # a deregistration, from its own thread
        assert payload.called.wait(ENDS)
        assert payload.aborted == [True]
        peer.settimeout(ENDS)
        assert peer.recv(16) == ANSWER  # the read side only was shut: the answer still goes out
        until(lambda: connection.phase == LINGER)
        assert not connection.gone.is_set()


def test_an_abort_before_an_empty_payload_reports_it_aborted() -> None:
    """The deregistration can come between the pin and the receive: a WRITE with nothing left to
    receive is then answered as aborted too."""
    with served(30.0) as (connection, _peer, reactor):
        payload = Payload(0)

        def pinned_then_aborted() -> None:
            payload.connection = connection
            connection.moving_begins(True)
            connection.abort()
            connection.receive(Pending(0, [memoryview(payload.buf)]), payload.received)

        on_reactor(reactor, pinned_then_aborted)
        assert payload.aborted == [True]


def test_an_abort_during_a_send_shuts_both_directions() -> None:
    """A READ's payloads go out of the pinned region: the abort must stop them, not only the reads."""
    with served(30.0, tcp=True) as (connection, peer, reactor):
        region = b"\7" * (32 * MIB)  # more than the loopback's buffers take: the send stalls
        sent = threading.Event()

        def send_region() -> None:
            connection.moving_begins(False)
            connection.send(Pending(len(region), [region]), sent.set)
            connection.pump()

        on_reactor(reactor, send_region)
        time.sleep(0.1)
        assert connection.phase == SENDING and not sent.is_set(), "the send did not stall on a full socket"
        connection.abort()
        got = 0
        peer.settimeout(2.0)
        with contextlib.suppress(OSError):
            while chunk := peer.recv(MIB):
                got += len(chunk)
        assert got < len(region), "the region's bytes kept going out after the abort"
        assert connection.gone.wait(ENDS)
        assert not sent.is_set()


def test_an_abort_outside_the_moves_shuts_nothing() -> None:
    with served(30.0) as (connection, peer, reactor):
        on_reactor(reactor, lambda: connection.moving_begins(False))
        assert not on_reactor_value(reactor, connection.moving_ends)
        connection.abort()
        connection.sock.send(b"answer")
        peer.settimeout(ENDS)
        assert peer.recv(16) == b"answer"


def on_reactor_value(reactor: Reactor, call: Callable[[], bool]) -> bool:
    got: list[bool] = []
    on_reactor(reactor, lambda: got.append(call()))
    return got[0]
