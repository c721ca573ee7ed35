"""The queue pair every software NIC shares: the contract's face over a ``SoftPairState`` and its threads.

A backend's queue pair (tcp, cma) adds how it connects and, for tcp, the
doorbell. Here: the post admission every post makes (a pair that may post,
a batch that fits the send queue), ``to_error``, ``close``'s locked half, and
the NIC threads, run so that an unexpected error becomes completions (the
pair fails GENERAL_ERR), never a thread exception nobody sees.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable
from typing import Any, ClassVar, Generic, TypeVar

from ...errors import InvalidArgument
from ...status import WcStatus
from ...work import WorkBatch
from ..base import BackendOptions, Endpoint, QpState, QueuePair, SendQueueFull
from .pair import check_shape
from .state import SoftPairState

__all__ = ["MAX_SEND_WR", "MAX_SGE", "OnClose", "SoftQueuePair"]

MAX_SEND_WR = 1 << 16
MAX_SGE = 256

_POSTABLE = (QpState.RTS, QpState.ERR)

OnClose = Callable[[Any], None]
"""What a pair calls once it is closed, with itself: its backend's ``_forget``."""

P = TypeVar("P", bound=SoftPairState)  # type: ignore[type-arg]


class SoftQueuePair(QueuePair, Generic[P]):
    """One software queue pair over its locked state ``pair_state``."""

    backend: ClassVar[str]
    """The backend's name, in messages, thread names and its logger's name."""

    def __init__(self, pair_state: P, options: BackendOptions, on_close: OnClose) -> None:
        self.qp_num = pair_state.qp_num
        self.max_send_wr = max(1, min(options.sq_depth, MAX_SEND_WR))
        self.max_sge = max(1, min(options.max_sge, MAX_SGE))
        self.pair_state = pair_state
        """The locked state the NIC threads share (public for inspection and tests)."""
        self._options = options
        self._on_close = on_close
        self._passive = False
        self._threads: list[threading.Thread] = []
        self.token = secrets.token_bytes(16)
        """The single-use token the passive side expects its peer's dial to present (random; tcp
        derives it instead once a session key is bound)."""

    @property
    def state(self) -> QpState:
        return self.pair_state.state

    # -- connecting -------------------------------------------------------------------

    def connect(self, remote: Endpoint) -> None:
        """An endpoint that is not ``accepting`` makes this the passive side: it waits for the
        peer's dial (no I/O here). Otherwise this side dials it (``_dial``, without the lock)."""
        if remote.get("backend") != self.backend:
            raise InvalidArgument(f"not a {self.backend} queue-pair endpoint: {self._shown(remote)}")
        st = self.pair_state
        with st.lock:
            if st.closed or st.state != QpState.INIT:
                raise InvalidArgument(f"connect needs a queue pair in INIT (qp {self.qp_num} is {st.state})")
            if not remote.get("accepting"):
                self._expect_dial_locked(remote)
                self._passive = True
                st.ready_locked()
                return
            self._before_dial_locked(remote)
        self._dial(remote)

    def _shown(self, remote: Endpoint) -> str:
        """An endpoint for an error message."""
        return repr(dict(remote))

    def _expect_dial_locked(self, remote: Endpoint) -> None:
        """Passive side: make the peer's dial find this pair (by its token)."""
        raise NotImplementedError

    def _before_dial_locked(self, remote: Endpoint) -> None:
        """Active side, under the lock before the dial: what may refuse it, or must be kept."""

    def _dial(self, remote: Endpoint) -> None:
        """Active side: dial ``remote``, then (under the lock) ``_check_still_connectable_locked``
        and start the NIC threads."""
        raise NotImplementedError

    def _check_still_connectable_locked(self, undo: Callable[[], None]) -> None:
        """After the dial, under the lock again: raise (after ``undo``) if the pair was closed meanwhile."""
        st = self.pair_state
        if st.closed or st.state != QpState.INIT:
            undo()
            raise InvalidArgument(f"qp {self.qp_num} was closed while connecting")

    # -- posting ------------------------------------------------------------------------

    def _admit_check_locked(self, n: int) -> str:
        """Raise unless this pair may post ``n`` more requests now (InvalidArgument: a passive, closed
        or unconnected pair; SendQueueFull: not enough free slots); the pair's state otherwise."""
        st = self.pair_state
        state = st.state
        if self._passive or st.closed or state not in _POSTABLE:
            raise InvalidArgument(
                f"qp {self.qp_num} cannot post: "
                + ("the passive pair only answers" if self._passive else f"it is {state}")
                + (" and closed" if st.closed else "")
            )
        used = st.used_locked()
        if used + n > self.max_send_wr:
            raise SendQueueFull(f"{n} requests, {self.max_send_wr - used} free slots of {self.max_send_wr}")
        return state

    def post(self, batch: WorkBatch) -> None:
        """Check and admit ``batch`` whole or not at all; the NIC threads take it from there."""
        n = len(batch)
        check_shape(batch, self.max_sge, self.qp_num)
        st = self.pair_state
        with st.lock:
            self._admit_check_locked(n)
            if n:
                st.admit_locked(batch)

    def to_error(self) -> None:
        self.pair_state.fail(WcStatus.WR_FLUSH_ERR, 0)

    def close(self) -> None:
        """Flush what is outstanding, then let the backend stop this pair's threads and connection."""
        st = self.pair_state
        with st.lock:
            if not st.close_locked():
                return
        # What connect and attach set is final now: both check ``closed`` under the lock.
        self._on_close(self)
        self._shut()

    def _shut(self) -> None:
        """After ``close`` flushed: end the connection, join the threads (not the caller's own)."""
        raise NotImplementedError

    # -- threads ------------------------------------------------------------------------

    def _start_threads(self, loops: dict[str, Callable[[], None]]) -> None:
        """Start one daemon thread per loop (named by its role) that runs it under ``_guard``."""
        self._threads = [
            threading.Thread(target=self._guard, args=(loop,), daemon=True,
                             name=f"moriio-{self.backend}-{role}-{self.qp_num}")
            for role, loop in loops.items()
        ]  # fmt: skip
        for thread in self._threads:
            thread.start()

    def _join_threads(self) -> None:
        current = threading.current_thread()
        for thread in self._threads:
            if thread is not current:
                thread.join()

    def _guard(self, loop: Callable[[], None]) -> None:
        """Run a NIC loop; an unexpected error becomes completions, never a thread exception."""
        try:
            loop()
        except BaseException:
            log = logging.getLogger(f"moriio_async.{self.backend}")
            log.exception("%s qp %d: NIC thread failed", self.backend, self.qp_num)
            self.pair_state.fail(WcStatus.GENERAL_ERR, 0)
