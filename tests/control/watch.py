"""Which fds a test's listener holds, and whether the running loop still watches them once closed."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket


def listening_fds(port: int) -> list[int]:
    """This process's fds of sockets listening on ``port``, found through /proc/self/fd (not the listener)."""
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = os.dup(int(name))
        except OSError:  # the listing's own fd, gone
            continue
        try:
            probe = socket.socket(fileno=fd)
        except OSError:  # not a socket
            os.close(fd)
            continue
        with probe, contextlib.suppress(OSError):
            if probe.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) and probe.getsockname()[1] == port:
                fds.append(int(name))
    return fds


def still_watched(fds: list[int]) -> list[int]:
    """Which of these closed fds the running loop still watches (and no longer does: the watch is removed).

    A socket opened next takes the same number, and a watch left on it breaks that socket's own
    add_reader/add_writer (FileNotFoundError on asyncio; on uvloop, libuv aborts the process). Both loops
    refuse to watch a closed fd (EBADF) unless they still watch it."""
    loop = asyncio.get_running_loop()
    watched = []
    for fd in fds:
        try:
            loop.add_reader(fd, lambda: None)
        except OSError as exc:
            assert exc.errno == errno.EBADF
            continue
        loop.remove_reader(fd)
        watched.append(fd)
    return watched
