"""One thread that serves every accepted data connection: readiness (epoll), timers, calls from other threads.

The answering side of the software NIC is a set of state machines (the
hello, ``hello.py``; the chunks, ``responder.py``) driven by this thread:
each watched file descriptor has one handler, whose ``ready`` runs when the
kernel says the socket can make progress. Every socket is non-blocking, so
a handler never waits: a slow or hostile peer costs the thread only the
calls that move its bytes, and what it owes in time (a hello's deadline, a
chunk's, a guesser's delay) is a timer here, never a sleep.

Other threads (the engine's loop closing a pair, a deregistration) reach a
connection only through ``call_soon`` (a queue and an eventfd that wakes
the poll) or through a socket shutdown, which the poll sees as readiness.

Lock rules (the deadlock this avoids: a deregistering thread holds a
region's lock and aborts the holders of its pins, while this thread pins and
unpins regions):

* This thread never blocks on a lock held across a wait: it takes a
  region's lock (pin, unpin), a pair's lock (attach, the end of service) and
  a responder's small socket lock, each for a few statements.
* It takes no region lock while holding a responder's socket lock (``abort``
  takes them in the other order), and never waits for a region to drain.
* ``call_soon`` takes only this object's ``_lock``, so any thread may call
  it holding anything.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import itertools
import logging
import os
import select
import threading
import time
from collections.abc import Callable
from typing import Final, Protocol

__all__ = ["IN", "OUT", "Handler", "Reactor", "Timer"]

log = logging.getLogger("moriio_async.tcp")

IN: Final = select.EPOLLIN
OUT: Final = select.EPOLLOUT
_MAX_EVENTS: Final = 256


class Handler(Protocol):
    """What a watched file descriptor is served by (on the reactor's thread only)."""

    def ready(self, events: int) -> None:
        """The socket can make progress (``events``: EPOLLIN, EPOLLOUT, EPOLLHUP, EPOLLERR bits)."""

    def shutdown(self) -> None:
        """The reactor is stopping: end this connection now (release what it holds, close its socket)."""


class Timer:
    """A call at a time on the reactor's thread; ``cancel`` from that thread."""

    __slots__ = ("call", "cancelled", "when")

    def __init__(self, when: float, call: Callable[[], None]) -> None:
        self.when = when
        self.call = call
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Reactor:
    """The thread, its epoll set, its timers, and the queue of calls other threads hand it."""

    def __init__(self, name: str) -> None:
        self._epoll = select.epoll()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll.register(self._wake, IN)
        self._handlers: dict[int, Handler] = {}
        self._masks: dict[int, int] = {}
        self._timers: list[tuple[float, int, Timer]] = []
        self._order = itertools.count()  # ties in the heap never compare Timers
        self._calls: collections.deque[Callable[[], None]] = collections.deque()
        self._lock = threading.Lock()
        self._closed = False  # under _lock: no call is queued, and the eventfd is gone
        self._stopping: Callable[[], None] | None = None
        self._helpers: list[threading.Thread] = []  # under _lock
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    @property
    def watched(self) -> int:
        """File descriptors watched now (connections, and the listening socket)."""
        return len(self._handlers)

    def on_thread(self) -> bool:
        return threading.current_thread() is self.thread

    # -- on the reactor's thread ----------------------------------------------------------------------

    def watch(self, fd: int, handler: Handler, mask: int) -> None:
        """Serve ``fd`` with ``handler`` for ``mask`` (0: only hang-ups and errors); replaces an earlier one."""
        if fd in self._handlers:
            self._handlers[fd] = handler
            self.want(fd, mask)
            return
        self._epoll.register(fd, mask)
        self._handlers[fd] = handler
        self._masks[fd] = mask

    def want(self, fd: int, mask: int) -> None:
        """Change what ``fd`` is watched for (a system call only when it changes)."""
        if self._masks.get(fd) != mask:
            self._epoll.modify(fd, mask)
            self._masks[fd] = mask

    def unwatch(self, fd: int) -> None:
        """Before its socket is closed (epoll would forget a closed fd, but not one still open elsewhere)."""
        if self._handlers.pop(fd, None) is not None:
            self._masks.pop(fd, None)
            with contextlib.suppress(OSError, ValueError):
                self._epoll.unregister(fd)

    def call_at(self, when: float, call: Callable[[], None]) -> Timer:
        timer = Timer(when, call)
        heapq.heappush(self._timers, (when, next(self._order), timer))
        return timer

    # -- from any thread ------------------------------------------------------------------------------

    def call_soon(self, call: Callable[[], None]) -> bool:
        """Run ``call`` on the reactor's thread soon; False if the reactor has stopped (it never will)."""
        with self._lock:
            if self._closed:
                return False
            self._calls.append(call)
            with contextlib.suppress(BlockingIOError):
                os.eventfd_write(self._wake, 1)
        return True

    def spawn(self, target: Callable[[], None], name: str) -> None:
        """Start a helper thread for a connection (fault hooks, which may block): joined by ``stop``."""
        thread = threading.Thread(target=target, name=name, daemon=True)
        with self._lock:
            self._helpers = [t for t in self._helpers if t.is_alive()]
            self._helpers.append(thread)
        thread.start()

    def stop(self, last: Callable[[], None]) -> None:
        """Run ``last`` on the thread, then shut every handler still watched down, and end the thread
        and the helpers (joined, unless called from one of them). Idempotent."""

        def stopping() -> None:
            self._stopping = last

        if self.call_soon(stopping) and not self.on_thread():
            self.thread.join()
        with self._lock:
            helpers, self._helpers = self._helpers, []
        for thread in helpers:
            if thread is not threading.current_thread():
                thread.join()

    # -- the thread ---------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._stopping is None:
                self._turn()
            self._stopping()
            for handler in list(self._handlers.values()):
                self._safely(handler.shutdown)
        finally:
            with self._lock:
                self._closed = True
                os.close(self._wake)
            self._epoll.close()
            self._calls.clear()
            self._timers.clear()

    def _turn(self) -> None:
        timeout = -1.0
        if self._timers:
            timeout = max(0.0, self._timers[0][0] - time.monotonic())
        if self._calls:
            timeout = 0.0
        try:
            events = self._epoll.poll(timeout, _MAX_EVENTS)
        except InterruptedError:
            events = []
        handlers = self._handlers
        for fd, mask in events:
            if fd == self._wake:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self._wake)
                continue
            handler = handlers.get(fd)
            if handler is not None:  # unwatched by an earlier handler in this batch
                self._safely(handler.ready, mask)
        if self._timers:
            now = time.monotonic()
            while self._timers and self._timers[0][0] <= now:
                timer = heapq.heappop(self._timers)[2]
                if not timer.cancelled:
                    self._safely(timer.call)
        # Only the calls queued so far: one that queues another runs it on the next turn, after the poll.
        for _ in range(len(self._calls)):
            self._safely(self._calls.popleft())

    @staticmethod
    def _safely(call: Callable[..., None], *args: int) -> None:
        """A handler's bug must not end the thread that serves every other connection."""
        try:
            call(*args)
        except Exception:
            log.exception("tcp data port: a connection's handler failed")
