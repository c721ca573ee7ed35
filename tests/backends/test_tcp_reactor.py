"""The TCP target serves every accepted connection from one reactor thread (issue 26): threads do not grow
with the peers, and no peer, however slow or hostile, holds the thread the others are served on.

The peers speak the data wire by hand (``datawire.py``), over real sockets."""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pytest

from moriio_async.backends import open_backend
from moriio_async.backends.base import Backend
from moriio_async.backends.tcp import TcpOptions
from moriio_async.backends.tcp.connection import BUDGET
from moriio_async.backends.tcp.reactor import IN, Reactor
from moriio_async.backends.tcp.regions import TcpRegion
from moriio_async.status import Access

from . import datawire as dw
from .harness import make_options

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.only_backends("tcp", reason="the TCP backend's data port, spoken by hand"),
]


@dataclass
class Pairs:
    backend: Backend
    port: int
    tokens: list[bytes]
    buf: np.ndarray
    mr: TcpRegion


@contextmanager
def pairs(n: int, **options: object) -> Iterator[Pairs]:
    """A backend with one 64 KiB exported region and ``n`` passive pairs waiting for their dial."""
    own = {k: options.pop(k) for k in list(options) if k in TcpOptions.__dataclass_fields__}
    backend = open_backend("tcp", make_options("tcp", **options, specific=TcpOptions(**own)))  # type: ignore[arg-type]
    try:
        buf = (np.arange(1 << 16) % 251).astype(np.uint8)
        mr = backend.register_memory(memoryview(buf), Access.all())
        assert isinstance(mr, TcpRegion)
        backend.export_memory(mr)
        tokens, port = [], 0
        for i in range(n):
            qp = backend.create_qp(backend.create_cq(64))
            qp.bind_session(None, answering=True)
            qp.connect({"backend": "tcp", "accepting": False, "host": "127.0.0.1", "port": 1, "qp_num": 100 + i})
            tokens.append(bytes.fromhex(str(qp.endpoint()["token"])))
            port = int(qp.endpoint()["port"])
        yield Pairs(backend, port, tokens, buf, mr)
    finally:
        backend.close()


def nic_threads() -> int:
    return sum(th.name.startswith("moriio-tcp") for th in threading.enumerate())


def served(p: Pairs, sock: socket.socket, seq: int, offset: int) -> None:
    """A WRITE then a READ of the same 4 KiB on ``sock``, answered and landed."""
    data = bytes([seq % 256]) * 4096
    sock.sendall(dw.chunk(dw.WRITE, seq, (p.mr.rkey, p.mr.addr + offset, 4096)) + data)
    r = dw.response(sock)
    assert (r.opcode, r.status, r.seq, r.done) == (dw.WRITE, dw.OK, seq, 1)
    sock.sendall(dw.chunk(dw.READ, seq + 1, (p.mr.rkey, p.mr.addr + offset, 4096)))
    r = dw.response(sock)
    assert (r.opcode, r.status, r.seq, r.done, r.payload) == (dw.READ, dw.OK, seq + 1, 1, 4096)
    assert dw.recv_exactly(sock, 4096) == data


def test_the_target_threads_stay_the_same_as_connections_grow() -> None:
    with pairs(48) as p:
        socks: list[socket.socket] = []
        try:
            counts = [nic_threads()]
            for i, token in enumerate(p.tokens):
                sock, status = dw.dial(p.port, token)
                socks.append(sock)
                assert status == dw.OK
                if i + 1 in (1, 8, 48):
                    counts.append(nic_threads())
            assert counts == [counts[0]] * 4, f"tcp threads at 0, 1, 8, 48 connections: {counts}"
            for i, sock in enumerate(socks):  # all at once, then every answer: each one is served
                sock.sendall(dw.chunk(dw.READ, i, (p.mr.rkey, p.mr.addr + 8 * i, 8)))
            for i, sock in enumerate(socks):
                r = dw.response(sock)
                assert (r.status, r.seq, r.done, r.payload) == (dw.OK, i, 1, 8)
                assert dw.recv_exactly(sock, 8) == p.buf[8 * i : 8 * i + 8].tobytes()
        finally:
            for sock in socks:
                sock.close()


@pytest.mark.parametrize("reactors", [1, 3])
def test_reactor_threads_set_how_many_threads_serve_the_connections(reactors: int) -> None:
    with pairs(6, reactor_threads=reactors) as p:
        assert p.backend.describe().threads.startswith(f"reactors {reactors} ")
        names = {th.name for th in threading.enumerate()}
        assert sum(f"moriio-tcp-nic-{p.port}-" in name for name in names) == reactors
        socks = [dw.dial(p.port, token)[0] for token in p.tokens]
        try:
            for i, sock in enumerate(socks):  # shared between the reactors, each one served
                served(p, sock, 2 * i, 4096 * i)
        finally:
            for sock in socks:
                sock.close()


def _silent_mid_payload(p: Pairs, sock: socket.socket) -> None:
    sock.sendall(dw.chunk(dw.WRITE, 0, (p.mr.rkey, p.mr.addr, 4096)) + b"\7" * 100)  # and nothing more


def _trickling_header(p: Pairs, sock: socket.socket) -> None:
    head = dw.chunk(dw.WRITE, 0, (p.mr.rkey, p.mr.addr, 4096))
    threading.Thread(target=dw.trickle, args=(sock, head, 0.05), daemon=True).start()


def _not_reading_its_responses(p: Pairs, sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    # 16 MiB of READ responses it never reads: the target's socket buffer fills, its send waits mid-chunk.
    sock.sendall(b"".join(dw.chunk(dw.READ, i, (p.mr.rkey, p.mr.addr, 1 << 16)) for i in range(256)))


@pytest.mark.parametrize("hostile", [_silent_mid_payload, _trickling_header, _not_reading_its_responses])
def test_a_hostile_connection_does_not_stop_another_on_the_same_target(hostile: object) -> None:
    assert callable(hostile)
    with pairs(2, retry_timeout=30.0) as p:
        bad, status = dw.dial(p.port, p.tokens[0])
        assert status == dw.OK
        try:
            hostile(p, bad)
            time.sleep(0.3)  # the target takes what the hostile peer sent, and is left waiting on it
            good, status = dw.dial(p.port, p.tokens[1])
            assert status == dw.OK
            with good:
                for seq in (0, 2, 4):
                    served(p, good, seq, 8192 + 4096 * seq)
            ready, _, _ = select.select([bad], [], [], 0)
            if hostile is not _not_reading_its_responses:
                assert not ready, "the hostile connection is still mid-chunk (within its 30 s deadline), not cut"
        finally:
            bad.close()


def test_deregistration_cuts_a_read_response_stuck_on_a_full_socket_and_unpins() -> None:
    """A peer that stops reading its READ responses holds the region pinned in a send waiting for the
    socket to drain; deregistration aborts it at once (service on that connection ends) and returns
    with the region unpinned, while the target goes on serving another connection."""
    with pairs(2, retry_timeout=30.0) as p:
        bad, status = dw.dial(p.port, p.tokens[0])
        assert status == dw.OK
        good, status = dw.dial(p.port, p.tokens[1])
        assert status == dw.OK
        with bad, good:
            _not_reading_its_responses(p, bad)
            deadline = time.monotonic() + 10
            while p.mr.pins == 0:  # its send is under way, the region pinned
                assert time.monotonic() < deadline, "the READ responses never started"
                time.sleep(0.01)
            p.backend.deregister_memory(p.mr)
            assert p.mr.pins == 0
            assert dw.closed_within(bad, 10.0), "a READ cut by deregistration ends service"
            other = np.zeros(4096, np.uint8)
            mr = p.backend.register_memory(memoryview(other), Access.all())
            p.backend.export_memory(mr)
            good.sendall(dw.chunk(dw.WRITE, 0, (mr.rkey, mr.addr, 4096)) + b"\5" * 4096)
            assert dw.response(good).status == dw.OK
            assert (other == 5).all()


def test_a_delayed_guess_waits_on_a_timer_while_other_peers_are_served() -> None:
    """A source over its budget of failed guesses has its next hello heard only after a quarter of the
    hello deadline. That wait is a timer, never a sleep on the thread every connection shares: an honest
    peer dials, and is served, while the guess is still waiting to be heard."""
    with pairs(1, max_failures_per_source=2, failure_lockout=60.0, hello_timeout=8.0) as p:
        for i in range(3):
            sock, status = dw.dial(p.port, i.to_bytes(16, "big"), source="127.0.0.2")
            sock.close()
            assert status == dw.UNKNOWN_TOKEN
        guess = socket.create_connection(("127.0.0.1", p.port), source_address=("127.0.0.2", 0))
        with guess:
            guess.sendall(dw.hello_bytes(b"\x09" * 16))  # heard only 2 s after its accept
            good, status = dw.dial(p.port, p.tokens[0])
            assert status == dw.OK
            with good:
                served(p, good, 0, 0)
            ready, _, _ = select.select([guess], [], [], 0)
            assert not ready, "the guess is still waiting to be heard"
            guess.settimeout(10)
            assert dw.HELLO_ACK.unpack(dw.recv_exactly(guess, dw.HELLO_ACK.size))[2] == dw.UNKNOWN_TOKEN


def test_connections_past_their_hello_never_count_against_the_hello_caps() -> None:
    # Ten connections from one address, one after another, through caps of two in their hello at once: each
    # one that finished its hello is out of the hello set (never evicted to make room for a later dial),
    # so every one of them is still served afterwards.
    with pairs(10, max_data_hellos=2, max_data_hellos_per_address=2, hello_timeout=0.2) as p:
        socks: list[socket.socket] = []
        try:
            for token in p.tokens:
                sock, status = dw.dial(p.port, token)
                socks.append(sock)
                assert status == dw.OK
                time.sleep(0.12)  # past half the hello deadline: ripe for eviction, were it still in its hello
            for i, sock in enumerate(socks):
                served(p, sock, 2 * i, 4096 * i)
        finally:
            for sock in socks:
                sock.close()


def test_a_connection_whose_socket_always_has_data_does_not_hold_the_reactor_turn() -> None:
    """One reactor thread, one connection with a long backlog of requests, another with one request, both
    in the kernel when the thread next polls: the backlog gets at most ``BUDGET`` socket calls, then the
    other connection is served, then the backlog goes on. Seen in the data: the backlog READs the byte
    the other connection's WRITE changes, so their answers say how many of them were served before it.

    The thread is held (a call queued on it that waits) while both connections' bytes arrive, so the
    order does not depend on timing. A one-request READ chunk is one socket call (its header and
    descriptor come in one ``recv``; the response is sent outside the budget), so exactly ``BUDGET`` of
    them are served first: the connection whose bytes came first is also reported first by epoll."""
    n = 4 * BUDGET
    with pairs(2, reactor_threads=1) as p:
        p.buf[0] = 0
        (busy, status), (other, status2) = dw.dial(p.port, p.tokens[0]), dw.dial(p.port, p.tokens[1])
        assert (status, status2) == (dw.OK, dw.OK)
        with busy, other:
            with dw.holding(p.backend.listener.reactors[0]):  # type: ignore[attr-defined]
                busy.sendall(b"".join(dw.chunk(dw.READ, i, (p.mr.rkey, p.mr.addr, 1)) for i in range(n)))
                dw.all_acked(busy)
                other.sendall(dw.chunk(dw.WRITE, 0, (p.mr.rkey, p.mr.addr, 1)) + b"\xee")
                dw.all_acked(other)
            r = dw.response(other)
            assert (r.opcode, r.status, r.seq, r.done) == (dw.WRITE, dw.OK, 0, 1)
            seen = []
            for i in range(n):
                r = dw.response(busy)
                assert (r.opcode, r.status, r.seq, r.done, r.payload) == (dw.READ, dw.OK, i, 1, 1)
                seen.append(dw.recv_exactly(busy, 1)[0])
            first = seen.index(0xEE) if 0xEE in seen else n
            assert seen == [0] * first + [0xEE] * (n - first), "the WRITE landed once, between two READs"
            assert first == BUDGET, f"{first} of the backlog's {n} READs were served before the other connection"


def test_a_connection_handed_to_another_reactor_is_started_on_that_reactors_thread() -> None:
    """The first reactor reads the hello; the connection is served by the one serving the fewest, which
    sends the ack, on its own thread. With that reactor held, the hello is read and answered on the
    first one (held next, once the hello is in: its next poll reads it), and still no ack has gone."""
    with pairs(1, reactor_threads=2) as p, socket.socket() as sock:
        first, second = p.backend.listener.reactors  # type: ignore[attr-defined]
        sock.settimeout(10)
        with dw.holding(second):
            sock.connect(("127.0.0.1", p.port))
            sock.sendall(dw.hello_bytes(p.tokens[0]))
            dw.all_acked(sock)
            with dw.holding(first):
                assert (first.watched, second.watched) == (1, 0), "the first let go of it, the second has not begun"
                ready, _, _ = select.select([sock], [], [], 0)
                assert not ready, "the ack went out before the reactor serving it ran"
        assert dw.HELLO_ACK.unpack(dw.recv_exactly(sock, dw.HELLO_ACK.size))[2] == dw.OK
        served(p, sock, 0, 0)
        assert (first.watched, second.watched) == (1, 1)


# -- the reactor itself: readiness, timers, calls from other threads, stopping ------------------------------


class Recorder:
    """A handler that records its readiness reports (and on which thread), and its shutdown."""

    def __init__(self, sock: socket.socket, order: list[str] | None = None) -> None:
        self.sock = sock
        self.order = [] if order is None else order  # "event" at each report, shared with what a test times
        self.events: list[int] = []
        self.threads: set[str] = set()
        self.shut = threading.Event()
        self.seen = threading.Event()

    def ready(self, events: int) -> None:
        self.order.append("event")
        self.events.append(events)
        self.threads.add(threading.current_thread().name)
        with contextlib.suppress(BlockingIOError):
            self.sock.recv(4096)
        self.seen.set()

    def shutdown(self) -> None:
        self.shut.set()


@contextmanager
def a_reactor() -> Iterator[Reactor]:
    reactor = Reactor("test-reactor")
    try:
        yield reactor
    finally:
        reactor.stop(lambda: None)


def both(*calls: Callable[[], object]) -> Callable[[], None]:
    def call() -> None:
        for c in calls:
            c()

    return call


def run_on(reactor: Reactor, call: Callable[[], object]) -> None:
    done = threading.Event()
    assert reactor.call_soon(both(call, done.set))
    assert done.wait(10)


@contextmanager
def socket_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        yield ours, theirs


def test_a_watched_socket_is_served_on_the_reactor_thread_for_what_it_is_watched_for() -> None:
    with a_reactor() as reactor, socket_pair() as (ours, theirs):
        ours.setblocking(False)
        handler = Recorder(ours)
        run_on(reactor, lambda: reactor.watch(ours.fileno(), handler, 0))
        assert reactor.watched == 1
        theirs.sendall(b"x")
        time.sleep(0.1)
        assert handler.events == [], "a socket watched for nothing but hang-ups was served for data"
        run_on(reactor, lambda: reactor.want(ours.fileno(), IN))
        assert handler.seen.wait(10)
        assert handler.events[0] & IN
        assert handler.threads == {"test-reactor"}
        other = Recorder(ours)  # watching a watched fd again replaces its handler and its mask
        run_on(reactor, lambda: reactor.watch(ours.fileno(), other, IN))
        assert reactor.watched == 1
        theirs.sendall(b"y")
        assert other.seen.wait(10)
        run_on(reactor, lambda: reactor.unwatch(ours.fileno()))
        run_on(reactor, lambda: reactor.unwatch(ours.fileno()))  # twice: nothing to forget
        assert reactor.watched == 0
        count = len(other.events)
        theirs.sendall(b"z")
        time.sleep(0.1)
        assert len(other.events) == count, "an unwatched socket was still served"


def test_timers_run_in_time_order_on_the_thread_and_a_cancelled_one_never_runs() -> None:
    with a_reactor() as reactor:
        ran: list[str] = []
        done = threading.Event()
        now = time.monotonic()

        def arm() -> None:
            reactor.call_at(now + 0.2, both(lambda: ran.append("late"), done.set))
            reactor.call_at(now + 0.1, lambda: ran.append("tie 1"))
            reactor.call_at(now + 0.1, lambda: ran.append("tie 2"))  # equal times: in the order armed
            reactor.call_at(now + 0.05, lambda: ran.append("first"))
            reactor.call_at(now + 0.1, lambda: ran.append("cancelled")).cancel()

        assert reactor.call_soon(arm)
        assert done.wait(10), "a timer of an otherwise idle reactor never ran"
        assert ran == ["first", "tie 1", "tie 2", "late"]
        assert time.monotonic() >= now + 0.2


def test_a_timer_runs_at_its_time_not_at_the_next_event() -> None:
    with a_reactor() as reactor, socket_pair() as (ours, theirs):
        ours.setblocking(False)
        order: list[str] = []
        handler = Recorder(ours, order)
        timer_ran = threading.Event()
        timer = both(lambda: order.append("timer"), timer_ran.set)
        run_on(reactor, lambda: reactor.watch(ours.fileno(), handler, IN))
        run_on(reactor, lambda: reactor.call_at(time.monotonic() + 0.05, timer))
        time.sleep(0.5)  # the timer's time, then long after it an event
        theirs.sendall(b"x")
        assert handler.seen.wait(10)
        assert timer_ran.is_set()
        assert order == ["timer", "event"], "the timer waited for the poll to be woken by an event"


def test_a_call_from_another_thread_wakes_an_idle_reactor_and_runs_on_its_thread() -> None:
    with a_reactor() as reactor:
        time.sleep(0.05)  # blocked in its poll, with no timer
        where: list[str] = []
        done = threading.Event()
        assert reactor.call_soon(both(lambda: where.append(threading.current_thread().name), done.set))
        assert done.wait(10)
        assert where == ["test-reactor"]
        assert not reactor.on_thread()


def test_calls_that_queue_calls_do_not_starve_the_sockets() -> None:
    with a_reactor() as reactor, socket_pair() as (ours, theirs):
        ours.setblocking(False)
        handler = Recorder(ours)
        stop = threading.Event()

        def again() -> None:  # a call that always queues another: run on the next turn, after the poll
            if not stop.is_set():
                reactor.call_soon(again)

        run_on(reactor, lambda: reactor.watch(ours.fileno(), handler, IN))
        reactor.call_soon(again)
        theirs.sendall(b"x")
        try:
            assert handler.seen.wait(10), "a chain of calls held the reactor from its sockets"
        finally:
            stop.set()


def test_a_failing_handler_is_logged_and_the_reactor_serves_on(caplog: pytest.LogCaptureFixture) -> None:
    with a_reactor() as reactor:

        def fails() -> None:
            raise RuntimeError("a handler's bug")

        reactor.call_soon(fails)
        done = threading.Event()
        assert reactor.call_soon(done.set)
        assert done.wait(10), "the reactor's thread ended with its handler's exception"
        assert [(r.getMessage(), r.exc_info is not None) for r in caplog.records] == [
            ("tcp data port: a connection's handler failed", True)
        ]


def test_stop_runs_last_on_the_thread_then_shuts_every_watched_handler_and_ends() -> None:
    reactor = Reactor("test-reactor")
    with socket_pair() as (ours, _theirs):
        handler = Recorder(ours)
        run_on(reactor, lambda: reactor.watch(ours.fileno(), handler, 0))
        order: list[str] = []
        helper_ran = threading.Event()
        release = threading.Event()

        def helper() -> None:  # still running when the reactor's thread has ended
            release.wait(10)
            time.sleep(0.2)
            helper_ran.set()

        reactor.spawn(helper, "test-helper")

        def last() -> None:
            order.append(threading.current_thread().name)
            assert not handler.shut.is_set(), "a handler was shut down before last ran"
            release.set()

        reactor.stop(last)
        assert order == ["test-reactor"]
        assert handler.shut.is_set()
        assert not reactor.thread.is_alive()
        assert helper_ran.is_set(), "stop returned before its helper thread ended"
        assert not reactor.call_soon(lambda: None), "a call was taken by a stopped reactor"
        reactor.stop(lambda: order.append("again"))  # idempotent: nothing runs
        assert order == ["test-reactor"]


def test_stop_from_the_reactor_thread_does_not_wait_for_itself() -> None:
    reactor = Reactor("test-reactor")
    returned = threading.Event()
    assert reactor.call_soon(both(lambda: reactor.stop(lambda: None), returned.set))
    reactor.thread.join(10)
    assert returned.is_set()
    assert not reactor.thread.is_alive()
