"""Device async events: one daemon thread per backend, the only thread the backend starts.

Why a thread: verbs reports port down, QP fatal, CQ error and device fatal
only through ``ibv_get_async_event``, and pyverbs makes that call holding the
GIL, so it must never be made on an idle device. The thread waits in
``select.poll`` (GIL released) on the async fd, made non-blocking, plus a
stop eventfd; when the async fd is readable it takes every pending event,
acknowledges each at once (``ibv_destroy_qp`` waits for acks), and hands the
type to the backend. What the backend does with it never raises here: the
failures surface as completions on the CQs, per the contract. Every second
(when idle) it also calls ``tick`` for the backend's flush safety net.

``stop`` writes the eventfd and joins; the thread owns no verbs object.
"""

from __future__ import annotations

import logging
import os
import select
import threading
from collections.abc import Callable

from ._pyverbs import Context

__all__ = ["EVENT_NAMES", "AsyncEventWatcher"]

log = logging.getLogger("moriio_async.verbs")

EVENT_NAMES = {
    0: "CQ_ERR", 1: "QP_FATAL", 2: "QP_REQ_ERR", 3: "QP_ACCESS_ERR", 4: "COMM_EST", 5: "SQ_DRAINED",
    6: "PATH_MIG", 7: "PATH_MIG_ERR", 8: "DEVICE_FATAL", 9: "PORT_ACTIVE", 10: "PORT_ERR",
    11: "LID_CHANGE", 12: "PKEY_CHANGE", 13: "SM_CHANGE", 14: "SRQ_ERR", 15: "SRQ_LIMIT_REACHED",
    16: "QP_LAST_WQE_REACHED", 17: "CLIENT_REREGISTER", 18: "GID_CHANGE", 19: "WQ_FATAL",
}  # fmt: skip

_TICK_MS = 1000


class AsyncEventWatcher:
    def __init__(self, ctx: Context, on_event: Callable[[int], None], on_tick: Callable[[], None]) -> None:
        if ctx.async_fd is None:
            raise ValueError("the device's async fd was not found")
        self._ctx = ctx
        self._fd = ctx.async_fd
        self._on_event = on_event
        self._on_tick = on_tick
        self._stop = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name=f"moriio-verbs-events-{ctx.name}", daemon=True)
        self.events_seen = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        if self._thread.is_alive():
            os.eventfd_write(self._stop, 1)
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("the async event thread did not stop within %.1fs", timeout)
                return
        os.close(self._stop)

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        poller.register(self._stop, select.POLLIN)
        while True:
            try:
                ready = poller.poll(_TICK_MS)
            except InterruptedError:
                continue
            fds = {fd for fd, _ in ready}
            if self._stop in fds:
                return
            if self._fd in fds:
                self._drain()
            try:
                self._on_tick()
            except Exception:
                log.exception("verbs flush safety net failed")

    def _drain(self) -> None:
        while (kind := self._ctx.get_async_event()) is not None:
            self.events_seen += 1
            try:
                self._on_event(kind)
            except Exception:
                log.exception("handling device event %s failed", EVENT_NAMES.get(kind, kind))
