"""The TCP data plane against hostile clients over real sockets (issue 8, data-plane half): derived
single-use tokens, exports, random never-reused rkeys, total deadlines per message, deregistration
that aborts a peer's request instead of waiting for it, and passive pairs that never dial nor join.

The hostile side speaks the data wire by hand (``datawire.py``)."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import msgspec
import numpy as np
import pytest

from moriio_async.backends import open_backend
from moriio_async.backends.base import Backend, MemoryRegion, QueuePair
from moriio_async.backends.tcp import Hooks, TcpBackend, TcpOptions, VendorErr
from moriio_async.backends.tcp.regions import KeyStream
from moriio_async.core.auth import token_for
from moriio_async.errors import InvalidArgument
from moriio_async.status import Access, WcStatus

from . import datawire as dw
from .harness import FakeTargetClient, make_options

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.only_backends("tcp", reason="the TCP backend's data port, spoken by hand"),
]

KEY = bytes(range(32))
"""A session key as the engine would bind (both ends of one authenticated link derive the same)."""


@dataclass
class Target:
    backend: Backend
    qp: QueuePair
    buf: np.ndarray
    mr: MemoryRegion

    @property
    def port(self) -> int:
        return int(self.qp.endpoint()["port"])

    @property
    def counters(self) -> dict[str, int]:
        return msgspec.structs.asdict(self.backend.describe().data_plane)


@contextmanager
def target(*, export: bool = True, key: bytes | None = None, **options: object) -> Iterator[Target]:
    """A backend with one 64 KiB region and a passive pair waiting for a dial from pair number 7."""
    own = {k: options.pop(k) for k in list(options) if k in TcpOptions.__dataclass_fields__}
    backend = open_backend("tcp", make_options("tcp", **options, specific=TcpOptions(**own)))  # type: ignore[arg-type]
    try:
        buf = np.zeros(1 << 16, np.uint8)
        mr = backend.register_memory(memoryview(buf), Access.all())
        if export:
            backend.export_memory(mr)
        qp = backend.create_qp(backend.create_cq(64))
        qp.bind_session(key, answering=True)
        qp.connect({"backend": "tcp", "accepting": False, "host": "127.0.0.1", "port": 1, "qp_num": 7})
        yield Target(backend, qp, buf, mr)
    finally:
        backend.close()


def random_token(t: Target) -> bytes:
    return bytes.fromhex(str(t.qp.endpoint()["token"]))


# -- tokens ---------------------------------------------------------------------------------------------


def test_with_a_session_key_the_token_is_derived_never_sent_and_good_once(caplog: pytest.LogCaptureFixture) -> None:
    with target(key=KEY) as t:
        endpoint = t.qp.endpoint()
        assert "token" not in endpoint and len(bytes.fromhex(endpoint["nonce"])) == 16
        for guess in (b"\0" * 16, token_for(b"another key of 32 bytes........", "x", 0)):
            sock, status = dw.dial(t.port, guess)
            assert status == dw.UNKNOWN_TOKEN and dw.closed_within(sock, 5)
            sock.close()
        qp_num = int(endpoint["qp_num"])
        token = token_for(KEY, f"tcp-data/{qp_num}/7/{endpoint['nonce']}", 0)
        sock, status = dw.dial(t.port, token)
        assert status == dw.OK, "a holder of the session key computes the token"
        t.buf[:8] = 5
        sock.sendall(dw.chunk(dw.READ, 0, (t.mr.rkey, t.mr.addr, 8)))
        assert dw.response(sock).status == 0 and dw.recv_exactly(sock, 8) == b"\5" * 8
        replay, status = dw.dial(t.port, token)
        assert status == dw.UNKNOWN_TOKEN, "a token is good for one connection"
        replay.close()
        sock.close()
        assert t.counters["refused_tokens"] == 3
    assert [r for r in caplog.records if "unknown or used token" in r.getMessage()], "refusals are logged"


@pytest.mark.parametrize("key", [None, KEY], ids=["random-token", "derived-token"])
def test_passive_pairs_opened_and_closed_leave_no_token_on_the_data_port(key: bytes | None) -> None:
    """A token waits on the data port from the passive connect until its dial; a pair closed first (its
    peer never dialed, or gave up) takes its token with it, so churn leaves the port holding nothing."""
    opts = make_options("tcp")
    a, b = open_backend("tcp", opts), open_backend("tcp", opts)
    try:
        assert isinstance(b, TcpBackend)
        cq_a, cq_b = a.create_cq(64), b.create_cq(64)
        for i in range(60):
            qa, qb = a.create_qp(cq_a), b.create_qp(cq_b)
            qa.bind_session(key, answering=False)
            qb.bind_session(key, answering=True)
            qb.connect(qa.endpoint())  # passive: its token now waits for qa's dial
            assert b.listener.waiting == 1
            if i % 3 == 0:
                qa.connect(qb.endpoint())  # dialed: the hello took the token
                assert qa.state == "RTS"
            elif i % 3 == 1:
                qa.close()  # the active side gives up before dialing
            (qb.close, qa.close)[i % 2]()
            (qa.close, qb.close)[i % 2]()
            assert b.listener.waiting == 0, f"pair {i} left its token behind"
    finally:
        a.close()
        b.close()


def test_guessed_tokens_are_counted_and_logged_at_a_rate(caplog: pytest.LogCaptureFixture) -> None:
    with target(max_failures_per_source=1000) as t:
        caplog.set_level(logging.WARNING, "moriio_async.tcp")
        for i in range(50):
            sock, status = dw.dial(t.port, i.to_bytes(16, "big"))
            assert status == dw.UNKNOWN_TOKEN
            sock.close()
        assert t.counters["refused_tokens"] == 50
        lines = [r for r in caplog.records if "unknown or used token" in r.getMessage()]
        assert len(lines) == 1, "one line per address per interval, not one per guess"
        assert t.counters["suppressed_log_lines"] >= 49


def dial_from(source: str, port: int, token: bytes, qp_num: int = 7) -> int | None:
    """The hello's status from a connection bound to ``source``; None if closed without an answer."""
    sock = socket.socket()
    try:
        sock.bind((source, 0))
        sock.settimeout(5.0)
        sock.connect(("127.0.0.1", port))
        sock.sendall(dw.hello_bytes(token, qp_num))
        return int(dw.HELLO_ACK.unpack(dw.recv_exactly(sock, dw.HELLO_ACK.size))[2])
    except ConnectionError:
        return None
    finally:
        sock.close()


def test_token_guesses_past_the_budget_each_wait_and_an_honest_dial_from_there_still_gets_in() -> None:
    """Issue 23: 2,800-3,500 token guesses a second, unlimited. Each unknown token is a failure charged to its
    source: past max_failures_per_source every new connection from there waits a quarter of the hello
    deadline before it is heard (a timer, not a thread), so each guess costs the guesser that long; a real dial
    from the same address (every local process is 127.0.0.1) is delayed, not refused."""
    with target(max_failures_per_source=8, failure_lockout=60.0, hello_timeout=0.8) as t:
        answered = [dial_from("127.0.0.2", t.port, i.to_bytes(16, "big")) for i in range(20)]
        assert answered == [dw.UNKNOWN_TOKEN] * 20
        assert t.counters["refused_tokens"] == 20
        assert t.counters["lockouts"] == 1
        assert t.counters["delayed"] == 12, "every guess past the budget waited before it was heard"
        assert dial_from("127.0.0.3", t.port, b"\1" * 16) == dw.UNKNOWN_TOKEN  # another source: not delayed
        assert t.counters["delayed"] == 12
        assert dial_from("127.0.0.2", t.port, random_token(t)) == dw.OK  # delayed, and served
        assert t.counters["delayed"] == 13


def test_both_sides_derive_the_same_token_and_disagreeing_sides_fail_clearly() -> None:
    opts = make_options("tcp")
    a, b = open_backend("tcp", opts), open_backend("tcp", opts)
    try:
        buf = np.zeros(4096, np.uint8)
        mr = b.register_memory(memoryview(buf), Access.all())
        b.export_memory(mr)
        qa, qb = a.create_qp(a.create_cq(8)), b.create_qp(b.create_cq(8))
        qa.bind_session(KEY, answering=False)
        qb.bind_session(KEY, answering=True)
        qb.connect(qa.endpoint())
        qa.connect(qb.endpoint())
        assert qa.state == qb.state == "RTS"
        other = b.create_qp(b.create_cq(8))
        other.bind_session(KEY, answering=True)
        plain = a.create_qp(a.create_cq(8))  # no session key: it expects a token, the endpoint has a nonce
        other.connect(plain.endpoint())
        with pytest.raises(InvalidArgument, match="same shared secret"):
            plain.connect(other.endpoint())
    finally:
        a.close()
        b.close()


def test_an_answering_pair_never_dials() -> None:
    listening = socket.create_server(("127.0.0.1", 0))
    listening.setblocking(False)
    backend = open_backend("tcp", make_options("tcp"))
    try:
        qp = backend.create_qp(backend.create_cq(8))
        qp.bind_session(None, answering=True)
        endpoint = {"backend": "tcp", "accepting": True, "host": "127.0.0.1", "port": listening.getsockname()[1],
                    "qp_num": 9, "token": "ab" * 16}  # fmt: skip
        with pytest.raises(InvalidArgument, match="never dials"):
            qp.connect(endpoint)
        time.sleep(0.05)
        with pytest.raises(BlockingIOError):
            listening.accept()  # nobody dialed
    finally:
        backend.close()
        listening.close()


# -- exports and keys -----------------------------------------------------------------------------------


def test_an_unexported_region_is_an_unknown_rkey_counted_and_reported() -> None:
    with target(export=False) as t:
        seen: list[tuple[int, str]] = []
        t.backend.watch_access_errors(lambda qp, detail: seen.append((qp, detail)))
        t.buf[:] = 9
        sock, status = dw.dial(t.port, random_token(t))
        assert status == dw.OK
        sock.sendall(dw.chunk(dw.READ, 0, (t.mr.rkey, t.mr.addr, 64)))
        r = dw.response(sock)
        assert (r.status, r.vendor, r.done, r.payload) == (dw.REM_ACCESS_ERR, VendorErr.UNKNOWN_RKEY, 0, 0)
        assert dw.closed_within(sock, 5)
        sock.close()
        assert t.counters["access_errors"] == 1
        assert seen and seen[0][0] == t.qp.qp_num and "UNKNOWN_RKEY" in seen[0][1]
        # Exported, the same request is served on a fresh pair.
        t.backend.export_memory(t.mr)
        qp = t.backend.create_qp(t.backend.create_cq(8))
        qp.connect({"backend": "tcp", "accepting": False, "host": "127.0.0.1", "port": 1, "qp_num": 8})
        sock, status = dw.dial(t.port, bytes.fromhex(str(qp.endpoint()["token"])), 8)
        sock.sendall(dw.chunk(dw.READ, 0, (t.mr.rkey, t.mr.addr, 64)))
        assert dw.response(sock).status == 0 and dw.recv_exactly(sock, 64) == b"\x09" * 64
        sock.close()


def test_rkeys_are_random_and_never_reused() -> None:
    backend = open_backend("tcp", make_options("tcp"))
    try:
        buf = np.zeros(64, np.uint8)
        keys: list[int] = []
        for _ in range(300):
            mr = backend.register_memory(memoryview(buf), Access.all())
            keys += [mr.rkey, mr.lkey]
            backend.deregister_memory(mr)
        assert len(set(keys)) == len(keys) and 0 not in keys
        steps = np.diff(np.array(keys, dtype=np.int64))
        assert len(set(steps.tolist())) > len(steps) // 2, "keys are not a sequence"
        assert sum(k < 1 << 16 for k in keys) < 10, "keys spread over 32 bits"
    finally:
        backend.close()


def test_the_key_stream_is_a_permutation() -> None:
    stream = KeyStream()
    sample = [stream.permute(x) for x in range(1 << 16)]
    assert len(set(sample)) == len(sample)
    assert all(0 <= k < 1 << 32 for k in sample)
    assert KeyStream().permute(1) != stream.permute(1) or KeyStream().permute(2) != stream.permute(2)


# -- deadlines --------------------------------------------------------------------------------------------


def test_a_trickled_hello_is_cut_at_its_deadline() -> None:
    """Issue 8: a 28-byte hello sent a byte at a time kept a thread 32 s (the timeout was per recv)."""
    with target(connect_timeout=1.0) as t:
        sock = socket.create_connection(("127.0.0.1", t.port))
        sender = threading.Thread(target=dw.trickle, args=(sock, dw.hello_bytes(random_token(t)), 0.2))
        sender.start()
        assert dw.closed_within(sock, 4.0), "the 28-byte hello would take 5.6 s; the deadline is 1 s"
        sender.join()
        sock.close()
        assert t.counters["slow_messages"] == 1


@pytest.mark.parametrize("part", ["header", "payload"])
def test_a_trickled_chunk_is_cut_at_its_deadline(part: str) -> None:
    with target(retry_timeout=1.0) as t:
        sock, status = dw.dial(t.port, random_token(t))
        assert status == dw.OK
        head = dw.chunk(dw.WRITE, 0, (t.mr.rkey, t.mr.addr, 4096))
        if part == "header":
            data = head
        else:
            sock.sendall(head + b"\1" * 100)
            data = b"\2" * 100
        # A byte every 0.2 s: without a total deadline the header alone takes 9.6 s to arrive (the
        # payload's 100 bytes 20 s), so the 8 s window tells a cut (about 2 s) from none even on a
        # machine slowed several-fold, as under mutation testing's tracing.
        sender = threading.Thread(target=dw.trickle, args=(sock, data, 0.2))
        sender.start()
        assert dw.closed_within(sock, 8.0), "every byte came within the silence timeout; the total did not"
        sender.join()
        sock.close()
        assert t.counters["slow_messages"] == 1


@pytest.mark.parametrize("cap", [64, 5])
def test_hellos_under_way_are_capped_and_the_oldest_makes_room(cap: int) -> None:
    """At most ``max_data_hellos`` connections sit in their hello (the default, and a configured cap). Issue
    23: one more was refused, so 64 silent sockets kept every real dial out. Now one that had half its hello
    deadline goes to make room: a real dial gets in while the silent ones are held."""
    options: dict[str, object] = {"hello_timeout": 6.0, "max_data_hellos_per_address": 1000}
    with target(**options, **({} if cap == 64 else {"max_data_hellos": cap})) as t:
        idle = [socket.create_connection(("127.0.0.1", t.port)) for _ in range(cap)]
        try:
            time.sleep(3.3)  # past the grace (3 s), well within the deadline (6 s)
            sock, status = dw.dial(t.port, random_token(t))
            sock.close()
            assert status == dw.OK, "a real dial gets in while the idle connections are held"
            assert dw.closed_within(idle[0], 5.0), "the oldest one made room"
            assert t.counters["evicted_hellos"] >= 1
        finally:
            for s in idle:
                s.close()
        t.qp.close()
        reactors = t.backend.listener.reactors  # type: ignore[attr-defined]
        deadline = time.monotonic() + 10
        while sum(r.watched for r in reactors) > 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sum(r.watched for r in reactors) == 1, "every connection the hostile sockets held has ended"


def test_passive_close_does_not_join_its_responder() -> None:
    release = threading.Event()

    class Stuck(Hooks):
        def on_request(self, qp_num: int, opcode: int, rkey: int, remote_addr: int, length: int) -> None:
            release.wait(10)  # the connection's hook thread is busy in here

    with target() as t:
        t.qp.hooks = Stuck()  # type: ignore[attr-defined]
        sock, status = dw.dial(t.port, random_token(t))
        assert status == dw.OK
        sock.sendall(dw.chunk(dw.READ, 0, (t.mr.rkey, t.mr.addr, 8)))
        time.sleep(0.2)
        responders = [th for th in threading.enumerate() if th.name.startswith("moriio-tcp-hooks")]
        assert responders
        started = time.perf_counter()
        t.qp.close()
        assert time.perf_counter() - started < 5.0
        assert any(th.is_alive() for th in responders), "close returned while its responder is still busy"
        release.set()
        sock.close()
        assert isinstance(t.backend, TcpBackend)
    for th in responders:
        assert not th.is_alive(), "the backend's close joined it"


@pytest.mark.parametrize("part", ["header", "payload"])
def test_a_target_trickling_its_read_response_is_cut_at_the_deadline(part: str) -> None:
    """The initiator's side too: a hostile target that answers a READ a byte at a time (each within
    the silence timeout) fails the request with RETRY_EXC_ERR at the response's deadline."""
    fake = socket.create_server(("127.0.0.1", 0))
    backend = open_backend("tcp", make_options("tcp", retry_timeout=1.0))
    stop = threading.Event()

    def serve() -> None:
        conn, _ = fake.accept()
        with conn:
            dw.accept_one_request(conn)
            head = dw.RESPONSE.pack(dw.READ, 0, 0, 0, 1, 0, 4096)
            if part == "payload":
                conn.sendall(head + b"\1" * 100)
                head = b"\2" * 3996
            for i in range(len(head)):
                if stop.wait(0.2):
                    return
                try:
                    conn.send(head[i : i + 1])
                except OSError:
                    return

    server = threading.Thread(target=serve)
    server.start()
    try:
        client = FakeTargetClient.dial(backend, fake.getsockname()[1], 4096)
        client.read(1, 0, 4096)
        [wc] = client.waiter.wait(1, timeout=4.0)  # the trickle would take 4.8 s (header) or 800 s (payload)
        assert wc.status is WcStatus.RETRY_EXC_ERR and wc.vendor_err == VendorErr.PEER_SILENT
    finally:
        stop.set()
        backend.close()
        server.join()
        fake.close()
