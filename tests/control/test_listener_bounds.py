"""The control listener's bounds: how many connections one wakeup takes (its default backlog) before it gives
the event loop back, and how much it reads from a client it refuses."""

from __future__ import annotations

import asyncio
import socket

import pytest

from moriio_async.control.listener import Listener

from .test_listener import Accepted
from .wire import messages

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

    from moriio_async.aio import listener as module

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
