"""The control listener's hand-over of an accepted socket: a connection whose streams cannot be made (the
client left at once) is closed, logged at debug level, and no longer counted as pending."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from typing import Any

import pytest

from moriio_async.control.listener import Listener

from .test_listener import Accepted, Admitted


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
