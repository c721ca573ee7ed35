"""A hostile (or merely hand-written) TCP data-plane client: the wire of ``backends/tcp/wire.py``, by hand.

Nothing here uses the backend's own framing: structs are spelled out from the
wire's documentation, so the tests see the data port as another
implementation (or an attacker) would.
"""

from __future__ import annotations

import asyncio
import fcntl
import socket
import struct
import termios
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

HELLO = struct.Struct("<4sHH16sI")  # magic, version, flags, token, active qp_num
HELLO_ACK = struct.Struct("<4sHHI")  # magic, version, status, passive qp_num
CHUNK = struct.Struct("<BBHIII")  # opcode, flags, reserved, seq, count, reserved
DESC = struct.Struct("<IIQQ")  # rkey, reserved, remote addr, length
RESPONSE = struct.Struct("<BBHIIIQ")  # opcode, status, vendor_err, seq, done, reserved, payload bytes
MAGIC, VERSION = b"MRIO", 2
WRITE, READ = 0, 4  # Opcode.RDMA_WRITE, Opcode.RDMA_READ (ibv_wc_opcode values)
OK, UNKNOWN_TOKEN = 0, 1
REM_ACCESS_ERR = 10


@dataclass(frozen=True)
class Response:
    opcode: int
    status: int
    vendor: int
    seq: int
    done: int
    payload: int


def hello_bytes(token: bytes, qp_num: int = 7) -> bytes:
    return HELLO.pack(MAGIC, VERSION, 0, token, qp_num)


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        got = sock.recv(n - len(out))
        if not got:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += got
    return out


def dial(
    port: int, token: bytes, qp_num: int = 7, timeout: float = 5.0, source: str | None = None
) -> tuple[socket.socket, int]:
    """Open a data connection (from the address ``source``, if given) and say hello with ``token``; the
    socket and the hello-ack's status."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(source or "", 0))
    try:
        sock.sendall(hello_bytes(token, qp_num))
        _magic, _version, status, _qp = HELLO_ACK.unpack(recv_exactly(sock, HELLO_ACK.size))
    except OSError:  # refused without an answer (ConnectionError), or timed out: nothing left open
        sock.close()
        raise
    return sock, status


def accept_one_request(conn: socket.socket, qp_num: int = 99) -> bytes:
    """A fake target's side: take the hello, accept it, and read one single-request chunk (no payload)."""
    recv_exactly(conn, HELLO.size)
    conn.sendall(HELLO_ACK.pack(MAGIC, VERSION, OK, qp_num))
    return recv_exactly(conn, CHUNK.size + DESC.size)


def chunk(opcode: int, seq: int, *descs: tuple[int, int, int]) -> bytes:
    """A chunk header and its descriptors ``(rkey, addr, length)`` (a WRITE's payloads follow separately)."""
    return CHUNK.pack(opcode, 0, 0, seq, len(descs), 0) + b"".join(DESC.pack(r, 0, a, n) for r, a, n in descs)


def response(sock: socket.socket) -> Response:
    return Response(*(v for i, v in enumerate(RESPONSE.unpack(recv_exactly(sock, RESPONSE.size))) if i != 5))


def trickle(sock: socket.socket, data: bytes, every: float) -> None:
    """Send ``data`` one byte at a time, ``every`` seconds apart (stops quietly if the peer closed)."""
    for i in range(len(data)):
        try:
            sock.send(data[i : i + 1])
        except OSError:
            return
        time.sleep(every)


class Dripper:
    """A thread that sends one byte (``\\x07``) every ``every`` seconds until stopped or the peer closes:
    the payload of a request that never finishes arriving. Use as a context manager."""

    def __init__(self, sock: socket.socket, every: float) -> None:
        self.sock, self.every = sock, every
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, name="dripper", daemon=True)

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                self.sock.send(b"\7")
            except OSError:
                return
            self.stopped.wait(self.every)

    def __enter__(self) -> Dripper:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.thread.join()


@dataclass
class LoopGaps:
    """The running loop's gaps while it is entered: a task sleeps ``tick`` seconds at a time and records how
    long each sleep really took, so a gap far above ``tick`` is the loop standing still."""

    tick: float = 0.002
    gaps: list[float] = field(default_factory=list)
    task: asyncio.Task[None] | None = None

    async def tock(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(self.tick)
            now = time.perf_counter()
            self.gaps.append(now - last)
            last = now

    async def __aenter__(self) -> LoopGaps:
        self.task = asyncio.get_running_loop().create_task(self.tock())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.task is not None
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    @property
    def longest(self) -> float:
        return max(self.gaps, default=0.0)


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """The peer closed (or reset) the connection within ``seconds``, whatever it said before."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except OSError:
        return True
    return True


def all_acked(sock: socket.socket) -> None:
    """Wait until the peer's kernel has acknowledged every byte sent on ``sock``: they sit in the peer
    socket's receive queue, so its epoll already reports it readable."""
    deadline = time.monotonic() + 10
    while int.from_bytes(fcntl.ioctl(sock, termios.TIOCOUTQ, b"\0" * 4), "little"):  # bytes not acknowledged
        assert time.monotonic() < deadline, "the peer's kernel never acknowledged the bytes"
        time.sleep(0.005)


class CallsSoon(Protocol):
    def call_soon(self, call: Callable[[], None]) -> bool: ...


@contextmanager
def holding(reactor: CallsSoon) -> Iterator[None]:
    """Hold the target's reactor thread (a call queued on it waits) for the ``with`` block: what arrives
    meanwhile is all in the kernel when the thread next polls, in the order it came."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        release.wait(30)

    def hold_after_a_poll() -> None:
        # Queued from the thread, ``hold`` runs after the next poll, which drops the entries epoll still
        # keeps for sockets from earlier (an fd added or reported is re-checked at the next wait): else an
        # old entry of a socket that got bytes later could be reported ahead of another's newer one.
        reactor.call_soon(hold)

    assert reactor.call_soon(hold_after_a_poll)
    assert held.wait(10), "the reactor never ran the queued call"
    try:
        yield
    finally:
        release.set()
