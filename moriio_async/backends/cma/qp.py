"""The cma queue pair: the contract's face over its locked state (``pairstate.py``) and its threads.

The active side (the initiator, the one that posts) dials the passive side's
backend in ``connect`` and then runs two threads: the worker, which executes
requests (``worker.py``), and the reader, which applies revocations and sees
the target go (``initiator.py``). The passive side only answers: the target
port's thread for its connection hands out memfds and collects acks.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from collections.abc import Callable

from ...errors import InvalidArgument
from ...status import WcStatus
from ...work import WorkBatch
from ..base import BackendOptions, Endpoint, QpState, QueuePair, SendQueueFull
from ..options import CmaOptions
from ..softcq import SoftCompletionQueue
from ..softpair import check_shape
from .initiator import TargetLink, dial
from .iov import Mover
from .pairstate import PairState
from .regions import LocalTable
from .target import Connection, TargetPort
from .worker import Executor, work_loop

__all__ = ["MAX_SEND_WR", "MAX_SGE", "CmaQueuePair"]

log = logging.getLogger("moriio_async.cma")

MAX_SEND_WR = 1 << 16
MAX_SGE = 256


class CmaQueuePair(QueuePair):
    def __init__(
        self,
        qp_num: int,
        cq: SoftCompletionQueue,
        local: LocalTable,
        port: TargetPort,
        options: BackendOptions,
        tuning: CmaOptions,
        on_close: Callable[[CmaQueuePair], None],
    ) -> None:
        self.qp_num = qp_num
        self.max_send_wr = max(1, min(options.sq_depth, MAX_SEND_WR))
        self.max_sge = max(1, min(options.max_sge, MAX_SGE))
        self.token = secrets.token_bytes(16)
        self.pair_state = PairState(qp_num, cq)
        """The locked state the threads share (public for inspection and tests)."""
        self.link: TargetLink | None = None
        """The active side's connected target."""
        self._local = local
        self._port = port
        self._options = options
        self._tuning = tuning
        self._on_close = on_close
        self._passive = False
        self._conn: Connection | None = None
        self._mover: Mover | None = None
        self._threads: list[threading.Thread] = []

    # -- the contract -----------------------------------------------------------------

    @property
    def state(self) -> QpState:
        return self.pair_state.state

    def endpoint(self) -> Endpoint:
        return {
            "backend": "cma",
            "socket": self._port.name,
            "boot_id": self._port.boot,
            "pid": os.getpid(),
            "qp_num": self.qp_num,
            "token": self.token.hex(),
            # True once connect() made this the passive side: the peer then dials it.
            "accepting": self._passive,
        }

    def connect(self, remote: Endpoint) -> None:
        if remote.get("backend") != "cma":
            raise InvalidArgument(f"not a cma queue-pair endpoint: {dict(remote)!r}")
        st = self.pair_state
        with st.lock:
            if st.closed or st.state != QpState.INIT:
                raise InvalidArgument(f"connect needs a queue pair in INIT (qp {self.qp_num} is {st.state})")
            if not remote.get("accepting"):
                # Passive side: the active pair will dial our backend with our token. No I/O here.
                self._passive = True
                st.state = QpState.RTS
                self._port.expect(self.token, self)
                return
        try:
            token = bytes.fromhex(str(remote["token"]))
            if len(token) != 16:
                raise ValueError("a token is 16 bytes")
        except (KeyError, ValueError, TypeError) as exc:
            raise InvalidArgument(f"malformed cma endpoint {dict(remote)!r}: {exc}") from exc
        link = dial(dict(remote), self.qp_num, token, self._options)
        with st.lock:
            if st.closed or st.state != QpState.INIT:
                link.close()
                raise InvalidArgument(f"qp {self.qp_num} was closed while connecting")
            self.link = link
            t = self._tuning
            self._mover = Mover(t.threads, t.split_bytes, f"moriio-cma-split-{self.qp_num}")
            ex = Executor(st, link, self._local, self._mover, t.round_bytes, self._options.connect_timeout)
            st.state = QpState.RTS
            self._threads = [
                threading.Thread(target=self._guard, args=(lambda: work_loop(st, ex),), daemon=True,
                                 name=f"moriio-cma-work-{self.qp_num}"),
                threading.Thread(target=self._guard, args=(lambda: link.read_loop(st),), daemon=True,
                                 name=f"moriio-cma-read-{self.qp_num}"),
            ]  # fmt: skip
            for thread in self._threads:
                thread.start()

    def post(self, batch: WorkBatch) -> None:
        n = len(batch)
        check_shape(batch, self.max_sge, self.qp_num)
        st = self.pair_state
        with st.lock:
            state = st.state
            if self._passive or st.closed or state not in (QpState.RTS, QpState.ERR):
                raise InvalidArgument(
                    f"qp {self.qp_num} cannot post: "
                    + ("the passive pair only answers" if self._passive else f"it is {state}")
                    + (" and closed" if st.closed else "")
                )
            used = st.posted - st.released
            if used + n > self.max_send_wr:
                raise SendQueueFull(f"{n} requests, {self.max_send_wr - used} free slots of {self.max_send_wr}")
            if n:
                st.admit_locked(batch)

    def to_error(self) -> None:
        self.pair_state.fail(WcStatus.WR_FLUSH_ERR, 0)

    def close(self) -> None:
        st = self.pair_state
        with st.lock:
            if st.closed:
                return
            st.closed = True
            st.fail_locked(WcStatus.WR_FLUSH_ERR, 0)
            conn, link = self._conn, self.link
        self._port.forget(self.token)
        self._on_close(self)
        if conn is not None:
            conn.shutdown()  # the initiator sees the end: its requests fail RETRY_EXC_ERR
        if link is not None:
            link.shutdown()
        current = threading.current_thread()
        for thread in self._threads:
            if thread is not current:
                thread.join()
        if link is not None:
            link.close()
        if self._mover is not None:
            self._mover.close()

    # -- the passive side ---------------------------------------------------------------

    def attach(self, conn: Connection) -> bool:
        st = self.pair_state
        with st.lock:
            if st.closed or st.state != QpState.RTS or self._conn is not None:
                return False
            self._conn = conn
            return True

    def detach(self) -> None:
        with self.pair_state.lock:
            self.pair_state.state = QpState.ERR

    # -- threads ------------------------------------------------------------------------

    def _guard(self, loop: Callable[[], None]) -> None:
        """Run a thread's loop; an unexpected error becomes completions, never a thread exception."""
        try:
            loop()
        except BaseException:
            log.exception("cma qp %d: thread failed", self.qp_num)
            self.pair_state.fail(WcStatus.GENERAL_ERR, 0)
