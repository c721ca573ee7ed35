"""The control listener on its own: what admit is asked, what a refused client hears, binding every
address of a host on one port, and closing; its bounds (how many connections one wakeup takes before it
gives the event loop back, how much it reads from a client it refuses), and its hand-over of an accepted
socket (a connection whose streams cannot be made is closed, logged at debug level, and no longer pending)."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
from typing import Any

import pytest

from moriio_async.control.listener import Listener

from .watch import listening_fds, still_watched
from .wire import messages, read_message


class Accepted:
    """``on_connection``: keeps the streams it is handed."""

    def __init__(self) -> None:
        self.streams: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.streams.append((reader, writer))

    async def count(self, n: int) -> None:
        for _ in range(500):
            if len(self.streams) >= n:
                return
            await asyncio.sleep(0.005)
        raise AssertionError(f"{len(self.streams)} connections handed over, not {n}")

    def close(self) -> None:
        for _, writer in self.streams:
            writer.close()


class Admitted:
    """``admit``: records each question (host, connections from it, connections pending) and lets
    every connection in."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, int, int]] = []

    def __call__(self, host: str, from_host: int, pending: int) -> str | None:
        self.asked.append((host, from_host, pending))
        return None


async def test_admit_is_asked_with_the_connections_not_yet_handed_over() -> None:
    admit = Admitted()
    asked = admit.asked
    accepted = Accepted()
    listener = Listener(accepted, admit=admit)
    port = await listener.start("127.0.0.1", 0)
    assert port == listener.port and port > 0
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]  # queued before the loop looks
    try:
        await accepted.count(3)
        assert asked == [("127.0.0.1", 0, 0), ("127.0.0.1", 1, 1), ("127.0.0.1", 2, 2)]
        clients.append(socket.create_connection(("127.0.0.1", port)))
        await accepted.count(4)
        assert asked[3:] == [("127.0.0.1", 0, 0)]  # every one handed over is no longer pending
        clients[0].sendall(b"ping")
        assert await accepted.streams[0][0].readexactly(4) == b"ping"
    finally:
        for client in clients:
            client.close()
        accepted.close()
        await listener.close()


async def test_a_refused_client_hears_why_and_is_closed() -> None:
    accepted = Accepted()
    listener = Listener(accepted, admit=lambda host, from_host, pending: "too many links from 127.0.0.1")
    port = await listener.start("127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"\x00\x00\x00\x02{}")  # what the client said first is read, not answered with a reset
        await writer.drain()
        reply = await read_message(reader)
        assert reply == {"op": "error", "re": None, "reason": "busy", "message": "too many links from 127.0.0.1"}
        assert await asyncio.wait_for(reader.read(), 5) == b""
        assert accepted.streams == []
    finally:
        writer.close()
        await listener.close()


async def test_an_admit_that_raises_closes_that_connection_and_asks_again_for_the_next(
    caplog: pytest.LogCaptureFixture,
) -> None:
    accepted = Accepted()
    asked: list[str] = []

    def admit(host: str, from_host: int, pending: int) -> str | None:
        asked.append(host)
        if len(asked) == 1:
            raise RuntimeError("admit bug")
        return None

    listener = Listener(accepted, admit=admit)
    port = await listener.start("127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed at once, not left open
        errors = [r for r in caplog.records if r.name == "moriio_async" and r.levelno == logging.ERROR]
        assert [r.getMessage() for r in errors] == [
            "control listener: admit failed for a connection from 127.0.0.1; closed it"
        ]
        assert errors[0].exc_info is not None and str(errors[0].exc_info[1]) == "admit bug"
        client = socket.create_connection(("127.0.0.1", port))
        try:
            await accepted.count(1)
            assert asked == ["127.0.0.1", "127.0.0.1"]
        finally:
            client.close()
    finally:
        writer.close()
        accepted.close()
        await listener.close()


async def test_every_address_of_the_host_listens_on_the_one_port() -> None:
    """An empty host is every address, IPv4 and IPv6 (each family its own socket, the IPv6 one v6-only):
    with port 0 the second family takes the port the first one got."""
    accepted = Accepted()
    listener = Listener(accepted)
    port = await listener.start("", 0)
    try:
        assert not listener.loopback_only
        for host in ("127.0.0.1", "::1"):
            _, writer = await asyncio.open_connection(host, port)
            writer.close()
        await accepted.count(2)
        families = {writer.get_extra_info("socket").family for _, writer in accepted.streams}
        assert families == {socket.AF_INET, socket.AF_INET6}
    finally:
        accepted.close()
        await listener.close()


async def test_a_port_taken_is_refused_with_the_address_and_leaves_nothing_open() -> None:
    first = Listener(Accepted())
    port = await first.start("127.0.0.1", 0)
    second = Listener(Accepted())
    try:
        with pytest.raises(
            OSError,
            match=rf"^\[Errno {errno.EADDRINUSE}\] cannot listen on 127.0.0.1:{port}: {os.strerror(errno.EADDRINUSE)}$",
        ) as info:
            await second.start("127.0.0.1", port)
        assert info.value.errno == errno.EADDRINUSE
        assert second.port == 0  # the sockets it made are closed and forgotten
    finally:
        await first.close()
        await second.close()


async def test_start_twice_is_an_error_and_close_stops_accepting() -> None:
    accepted = Accepted()
    listener = Listener(accepted)
    port = await listener.start("127.0.0.1", 0)
    with pytest.raises(RuntimeError, match=r"^this listener was already started$"):
        await listener.start("127.0.0.1", 0)
    assert listener.loopback_only
    assert listener.closed is False
    fds = listening_fds(port)
    assert fds
    await listener.close()
    assert still_watched(fds) == []
    await listener.close()
    assert listener.closed and listener.port == 0 and not listener.loopback_only
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", port)
    assert accepted.streams == []


async def test_a_listener_never_started_closes_quietly() -> None:
    listener = Listener(Accepted())
    await listener.close()
    assert listener.closed and listener.port == 0


async def test_a_connection_accepted_as_the_listener_closes_is_closed_not_handed_over() -> None:
    accepted = Accepted()
    closing: list[asyncio.Task[None]] = []

    def admit(host: str, from_host: int, pending: int) -> str | None:
        # The listener starts closing as this connection is accepted, before its streams exist.
        closing.append(asyncio.get_running_loop().create_task(listener.close()))
        return None

    listener = Listener(accepted, admit=admit)
    port = await listener.start("127.0.0.1", 0)
    client = socket.create_connection(("127.0.0.1", port))
    try:
        for _ in range(500):
            if closing:
                break
            await asyncio.sleep(0.005)
        await asyncio.wait_for(closing[0], 5)  # close waits for the connection accepted meanwhile
        client.settimeout(5)
        assert client.recv(1) == b""  # closed by the listener
        assert accepted.streams == []
    finally:
        client.close()


def failing_accept(monkeypatch: pytest.MonkeyPatch, port: int, error: OSError) -> list[float]:
    """The next accept() on ``port`` fails with ``error`` (once); the loop times of every accept call there.
    Other sockets (another test's leftover accept thread, say) accept as usual."""
    real = socket.socket.accept
    calls: list[float] = []

    def accept(sock: socket.socket) -> tuple[socket.socket, Any]:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.getsockname()[1] != port:
            return real(sock)
        calls.append(asyncio.get_running_loop().time())
        if len(calls) == 1:
            raise error
        return real(sock)

    monkeypatch.setattr(socket.socket, "accept", accept)
    return calls


def listener_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "moriio_async" and r.levelno == logging.WARNING]


async def test_an_accept_that_fails_is_logged_and_accepting_goes_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    accepted = Accepted()
    listener = Listener(accepted)
    port = await listener.start("127.0.0.1", 0)
    calls = failing_accept(monkeypatch, port, OSError(errno.EPROTO, "Protocol error"))
    client = socket.create_connection(("127.0.0.1", port))
    try:
        await accepted.count(1)
        assert listener_warnings(caplog) == [f"control listener: accept failed: [Errno {errno.EPROTO}] Protocol error"]
        assert calls[1] - calls[0] < 0.5  # not paused: the next look accepts it
    finally:
        client.close()
        accepted.close()
        await listener.close()


async def test_out_of_fds_pauses_accepting_for_a_second(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    accepted = Accepted()
    listener = Listener(accepted)
    port = await listener.start("127.0.0.1", 0)
    calls = failing_accept(monkeypatch, port, OSError(errno.EMFILE, "Too many open files"))
    client = socket.create_connection(("127.0.0.1", port))
    try:
        await accepted.count(1)
        assert listener_warnings(caplog) == [
            f"control listener: [Errno {errno.EMFILE}] Too many open files; not accepting for 1s"
        ]
        assert 1.0 - 1e-3 <= calls[1] - calls[0] < 3  # nothing accepted meanwhile, then accepting resumes
    finally:
        client.close()
        accepted.close()
        await listener.close()


async def test_a_listener_closed_while_paused_stays_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    accepted = Accepted()
    listener = Listener(accepted)
    port = await listener.start("127.0.0.1", 0)
    calls = failing_accept(monkeypatch, port, OSError(errno.ENFILE, "Too many open files in system"))
    client = socket.create_connection(("127.0.0.1", port))
    try:
        for _ in range(200):
            if calls:
                break
            await asyncio.sleep(0.005)
        await listener.close()  # during the pause: the resume is called off
        await asyncio.sleep(1.2)  # past the pause: nothing is watched again (the loop would report an error)
        assert len(calls) == 1 and accepted.streams == []
    finally:
        client.close()


def refused_reply(client: socket.socket) -> bytes:
    """Everything a refused client receives, to the end of the stream (a reset raises)."""
    client.settimeout(5)
    got = b""
    while chunk := client.recv(1 << 16):
        got += chunk
    return got


BUSY = {"op": "error", "re": None, "reason": "busy", "message": "full"}


@pytest.mark.parametrize("says", [b"", b"\x00\x00\x00\x02{}" * 100], ids=["silent", "spoke-first"])
async def test_a_refused_client_gets_its_answer_and_a_clean_end(says: bytes) -> None:
    """What the client sent before the refusal is read first, so the close is a clean end of stream, not
    a reset; a client that sent nothing is refused the same way."""
    listener = Listener(Accepted(), admit=lambda host, from_host, pending: "full")
    port = await listener.start("127.0.0.1", 0)
    client = socket.create_connection(("127.0.0.1", port))
    client.sendall(says)  # in the socket before the listener accepts (the loop has not run since)
    try:
        for _ in range(20):
            await asyncio.sleep(0.01)
        got = await asyncio.get_running_loop().run_in_executor(None, refused_reply, client)
        assert messages(got) == [BUSY]
    finally:
        client.close()
        await listener.close()


async def test_a_refused_client_gone_before_its_answer_is_closed_quietly(monkeypatch: pytest.MonkeyPatch) -> None:
    real_send = socket.socket.send

    def gone(sock: socket.socket, data: bytes, *flags: int) -> int:
        # Only the accepted connection's send fails: the event loop's self-pipe (an AF_UNIX pair,
        # written by call_soon_threadsafe when the executor's recv returns) must keep working, or
        # the loop never wakes for the answer.
        if sock.family == socket.AF_INET and sock.getsockname()[1] == port:
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")
        return real_send(sock, data, *flags)

    accepted = Accepted()
    listener = Listener(accepted, admit=lambda host, from_host, pending: "full")
    port = await listener.start("127.0.0.1", 0)
    monkeypatch.setattr(socket.socket, "send", gone)
    client = socket.create_connection(("127.0.0.1", port))
    try:
        client.settimeout(5)
        assert await asyncio.get_running_loop().run_in_executor(None, client.recv, 1) == b""  # closed, unanswered
    finally:
        client.close()
        await listener.close()


# -- bounds: connections per wakeup (the default backlog), bytes read from a refused client --------------


BACKLOG = 128
"""``Listener``'s default backlog: the listen queue, and the most connections one wakeup accepts."""


async def test_one_wakeup_accepts_at_most_the_default_backlog_then_the_next_takes_the_rest() -> None:
    """A flood of connections queued before the loop looks is taken 128 at a time (the default backlog), so
    other callbacks run in between; the kernel queues one more than the backlog, which the next wakeup takes."""
    loop = asyncio.get_running_loop()
    asked: list[int] = []
    batches: list[int] = []
    """How many connections admit had been asked about when each wakeup's accepts were done."""
    marked = [False]

    def end_of_wakeup() -> None:
        batches.append(len(asked))
        marked[0] = False

    def admit(host: str, from_host: int, pending: int) -> str | None:
        if not marked[0]:  # the first accept of a wakeup: mark where the wakeup ends
            marked[0] = True
            loop.call_soon(end_of_wakeup)
        asked.append(pending)
        return None

    accepted = Accepted()
    listener = Listener(accepted, admit=admit)
    port = await listener.start("127.0.0.1", 0)
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(BACKLOG + 1)]  # all queued at once
    try:
        await accepted.count(BACKLOG + 1)
        assert batches[:2] == [BACKLOG, BACKLOG + 1]
        assert asked[:BACKLOG] == list(range(BACKLOG))  # none handed over within the first wakeup
    finally:
        for client in clients:
            client.close()
        accepted.close()
        await listener.close()


def refused_end(client: socket.socket) -> tuple[bytes, str]:
    """What a refused client reads, and how its stream ends: "eof" (clean) or "reset"."""
    client.settimeout(5)
    got = b""
    try:
        while chunk := client.recv(1 << 16):
            got += chunk
    except ConnectionResetError:
        return got, "reset"
    return got, "eof"


@pytest.mark.parametrize(("says", "end"), [(1 << 16, "eof"), (100_000, "reset")])
async def test_a_refused_client_is_read_at_most_64_kib(says: int, end: str) -> None:
    """Before a refusal the listener reads what the client sent, up to 64 KiB, so that closing does not reset
    the connection under the answer; a client that sent more is not read further (a refusal costs one bounded
    read): closing with its bytes unread resets the connection."""
    listener = Listener(Accepted(), admit=lambda host, from_host, pending: "full")
    port = await listener.start("127.0.0.1", 0)
    client = socket.create_connection(("127.0.0.1", port))
    client.setblocking(False)  # the loop cannot run while this thread waits: a send that would wait fails instead
    assert client.send(bytes(says)) == says  # buffered before the listener accepts (the loop has not run since)
    client.setblocking(True)
    try:
        for _ in range(20):
            await asyncio.sleep(0.01)
        got, how = await asyncio.get_running_loop().run_in_executor(None, refused_end, client)
        assert how == end
        if end == "eof":
            assert messages(got) == [{"op": "error", "re": None, "reason": "busy", "message": "full"}]
    finally:
        client.close()
        await listener.close()


async def test_memory_for_hosts_served_one_after_another_does_not_grow_with_their_number() -> None:
    """What the listener keeps about a host (how many of its connections are being handed over) lasts only
    while it has one: clients from 64 more addresses, each handed over and gone before the next, leave the
    memory held by the listener's own code within 1 KiB of where 8 addresses left it. Measured with
    tracemalloc, counting only what was allocated in the listener's module and is still alive."""
    import tracemalloc

    from moriio_async.control import listener as module

    only_listener = [tracemalloc.Filter(True, module.__file__)]
    accepted = Accepted()
    listener = Listener(accepted)
    port = await listener.start("127.0.0.1", 0)
    served = 0

    async def serve(hosts: range) -> None:
        nonlocal served
        for last in hosts:
            client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                client.bind((f"127.0.1.{last}", 0))  # every 127.x.y.z is this host's loopback
                client.connect(("127.0.0.1", port))
                served += 1
                await accepted.count(served)
                writer = accepted.streams[-1][1]
                assert writer.get_extra_info("peername")[0] == f"127.0.1.{last}"
                writer.close()
            finally:
                client.close()

    async def held() -> int:
        for _ in range(3):  # the last connection's hand-over task finishes and is let go
            await asyncio.sleep(0)
        snapshot = tracemalloc.take_snapshot().filter_traces(only_listener)
        return sum(stat.size for stat in snapshot.statistics("filename"))

    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        await serve(range(1, 9))
        before = await held()
        await serve(range(9, 73))
        after = await held()
    finally:
        if started:
            tracemalloc.stop()
        accepted.close()
        await listener.close()
    # A host kept after its last hand-over costs about 80 bytes (its address, a slot in a dict): 5 KB for 64.
    assert after - before < 1024, f"{after - before} bytes more after 64 more hosts"


# -- the hand-over: a connection whose streams cannot be made --------------------------------------------


async def test_a_connection_whose_streams_fail_is_closed_logged_and_no_longer_pending(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = asyncio.open_connection
    opened: list[int] = []

    async def open_connection(**kwargs: Any) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        opened.append(1)
        if len(opened) == 1:  # the first client is gone by the time its streams are made
            raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")
        return await real(**kwargs)

    admit = Admitted()
    asked = admit.asked
    accepted = Accepted()
    listener = Listener(accepted, admit=admit)
    port = await listener.start("127.0.0.1", 0)
    monkeypatch.setattr(asyncio, "open_connection", open_connection)
    loop = asyncio.get_running_loop()
    first = socket.create_connection(("127.0.0.1", port))
    second: socket.socket | None = None
    try:
        with caplog.at_level(logging.DEBUG, logger="moriio_async"):
            first.settimeout(5)
            assert await loop.run_in_executor(None, first.recv, 1) == b""  # closed by the listener
            second = socket.create_connection(("127.0.0.1", port))
            await accepted.count(1)
        assert asked == [("127.0.0.1", 0, 0), ("127.0.0.1", 0, 0)]  # the failed one is not pending any more
        assert len(opened) == 2
        lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "moriio_async"]
        assert lines == [
            (
                logging.DEBUG,
                f"control listener: an accepted connection failed: [Errno {errno.ECONNRESET}] Connection reset by peer",
            )
        ]
        peer = accepted.streams[0][1].get_extra_info("peername")
        assert peer == second.getsockname()  # the streams handed over are the second client's, both ends
        accepted.streams[0][1].write(b"hi")
        second.settimeout(5)
        assert await loop.run_in_executor(None, second.recv, 2) == b"hi"
        second.sendall(b"yo")
        assert await accepted.streams[0][0].readexactly(2) == b"yo"
    finally:
        first.close()
        if second is not None:
            second.close()
        accepted.close()
        await listener.close()


async def test_a_host_is_pending_while_any_of_its_connections_is_being_wrapped(monkeypatch: pytest.MonkeyPatch) -> None:
    """admit's counts are per connection: one handed over leaves the others of its host pending."""
    real = asyncio.open_connection
    gate = asyncio.Event()
    opened: list[int] = []

    async def open_connection(**kwargs: Any) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        opened.append(1)
        if len(opened) == 1:  # the first connection's streams wait for the test
            await gate.wait()
        return await real(**kwargs)

    admit = Admitted()
    asked = admit.asked
    accepted = Accepted()
    listener = Listener(accepted, admit=admit)
    port = await listener.start("127.0.0.1", 0)
    monkeypatch.setattr(asyncio, "open_connection", open_connection)
    clients: list[socket.socket] = []
    try:
        clients.append(socket.create_connection(("127.0.0.1", port)))
        for _ in range(500):
            if opened:
                break
            await asyncio.sleep(0.005)
        for n in (1, 2):  # two more, each handed over while the first is still being wrapped
            clients.append(socket.create_connection(("127.0.0.1", port)))
            await accepted.count(n)
        gate.set()
        await accepted.count(3)
        clients.append(socket.create_connection(("127.0.0.1", port)))
        await accepted.count(4)
        host = "127.0.0.1"
        assert asked == [(host, 0, 0), (host, 1, 1), (host, 1, 1), (host, 0, 0)]
    finally:
        for client in clients:
            client.close()
        accepted.close()
        await listener.close()
