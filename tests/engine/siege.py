"""A hostile crowd: a thread holding many silent or trickling sockets to one port, from many source addresses.

Every socket is bound to its own loopback address (127.1.x.y) before it
connects, so per-address limits do not see one client. A socket the target
closes is opened again at once from the next address, so the crowd stays as
large as it was told to be for as long as it runs. Every other socket
trickles: one byte a quarter second, never a whole message.
"""

from __future__ import annotations

import contextlib
import errno
import resource
import selectors
import socket
import threading
import time
from collections.abc import Iterator


@contextlib.contextmanager
def open_files(needed: int) -> Iterator[None]:
    """Raise the soft RLIMIT_NOFILE to at least ``needed`` (within the hard limit) for the block."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = soft if soft >= needed else min(needed, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


class Siege:
    """``count`` unauthenticated sockets to ``127.0.0.1:port``, held open (reopened) until ``stop``."""

    def __init__(self, port: int, count: int) -> None:
        self.port = port
        self.count = count
        self.opened = 0
        """Sockets opened so far (reopened ones included)."""
        self.closed_by_target = 0
        self._next = 0
        self._stop = threading.Event()
        self._selector = selectors.DefaultSelector()
        self._thread = threading.Thread(target=self._run, name="siege", daemon=True)

    def __enter__(self) -> Siege:
        for i in range(self.count):
            self._open(trickle=bool(i % 2))
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        for key in list(self._selector.get_map().values()):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            sock.close()
        self._selector.close()

    def _address(self) -> str:
        n = self._next = self._next + 1
        return f"127.1.{(n >> 8) & 0xFF}.{(n & 0xFF) or 1}"

    def _open(self, *, trickle: bool) -> None:
        sock = socket.socket()
        sock.setblocking(False)
        try:
            sock.bind((self._address(), 0))
            err = sock.connect_ex(("127.0.0.1", self.port))
        except OSError:
            sock.close()
            return
        if err not in (0, errno.EINPROGRESS):
            sock.close()
            return
        self.opened += 1
        self._selector.register(sock, selectors.EVENT_READ, trickle)

    def _run(self) -> None:
        last_trickle = 0.0
        while not self._stop.is_set():
            for key, _ in self._selector.select(0.05):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:  # the target closed it: another one takes its place at once
                    self.closed_by_target += 1
                    self._selector.unregister(sock)
                    sock.close()
                    self._open(trickle=bool(key.data))
            now = time.monotonic()
            if now - last_trickle >= 0.25:
                last_trickle = now
                for key in list(self._selector.get_map().values()):
                    if key.data:
                        sock = key.fileobj
                        assert isinstance(sock, socket.socket)
                        with contextlib.suppress(OSError):
                            sock.send(b"\0")  # a length prefix that never ends
