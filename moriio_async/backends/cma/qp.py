"""The cma queue pair: the contract's face over its locked state (``pairstate.py``) and its threads.

The active side (the initiator, the one that posts) dials the passive side's
backend in ``connect`` and then runs two threads: the worker, which executes
requests (``worker.py``), and the reader, which applies revocations and sees
the target go (``initiator.py``). The passive side only answers: the target
port's thread for its connection hands out memfds and collects acks.

``post`` of at most ``CmaOptions.inline_bytes`` to an idle pair moves the
bytes on the posting thread, before it returns. With one batch in flight
that saves two thread hand-offs per batch (wake the worker; wake the poller
with the completion), each a scheduler wake-up that costs far more than its
CPU on a busy host. The cost is the copy's time on the caller's thread (the
event loop): about a millisecond per 8 MiB here, so the bound is in bytes.
The copy may still block there on the peer's memory (a target whose pages
fault slowly); only a same-user process is ever a cma peer, and that one
could stop this process outright (SIGSTOP), so this gives it nothing new.
What would wait on the target's answer (mapping a shared allocation) is
never done inline: the worker takes it over.
"""

from __future__ import annotations

import logging
import os

from ...errors import InvalidArgument
from ...status import WcStatus
from ...work import WorkBatch
from ..base import BackendOptions, Endpoint, QpState
from ..options import CmaOptions
from ..soft.pair import check_shape
from ..soft.qp import MAX_SEND_WR, MAX_SGE, OnClose, SoftQueuePair
from .initiator import TargetLink, dial
from .iov import Mover
from .kernel import IOV_MAX
from .pairstate import PairState
from .regions import LocalTable
from .target import Connection, TargetPort
from .worker import Executor, execute, work_loop

__all__ = ["MAX_SEND_WR", "MAX_SGE", "CmaQueuePair"]

log = logging.getLogger("moriio_async.cma")


class CmaQueuePair(SoftQueuePair[PairState]):
    """A cma pair over ``pair_state``: dials the target port of its peer's backend, or waits on ``port``."""

    backend = "cma"
    gathers_singles = True  # a busy pair's worker takes the gathered singles as one batch: one hand-off, not one each

    def __init__(
        self,
        pair_state: PairState,
        local: LocalTable,
        port: TargetPort,
        options: BackendOptions,
        tuning: CmaOptions,
        on_close: OnClose,
    ) -> None:
        super().__init__(pair_state, options, on_close)
        self.link: TargetLink | None = None
        """The active side's connected target."""
        self._local = local
        self._port = port
        self._tuning = tuning
        self._conn: Connection | None = None
        self._mover: Mover | None = None
        self._executor: Executor | None = None

    # -- the contract -----------------------------------------------------------------

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

    def _expect_dial_locked(self, remote: Endpoint) -> None:
        self._port.expected.expect(self.token, self)  # the active pair dials our backend with our token

    def _dial(self, remote: Endpoint) -> None:
        try:
            token = bytes.fromhex(str(remote["token"]))
            if len(token) != 16:
                raise ValueError("a token is 16 bytes")
        except (KeyError, ValueError, TypeError) as exc:
            raise InvalidArgument(f"malformed cma endpoint {dict(remote)!r}: {exc}") from exc
        link = dial(dict(remote), self.qp_num, token, self._options)
        st = self.pair_state
        with st.lock:
            self._check_still_connectable_locked(link.close)
            self.link = link
            t = self._tuning
            self._mover = Mover(t.threads, t.split_bytes, f"moriio-cma-split-{self.qp_num}")
            ex = Executor(st, link, self._local, self._mover, t.round_bytes, self._options.connect_timeout)
            self._executor = ex
            st.ready_locked()
            self._start_threads({"work": lambda: work_loop(st, ex), "read": lambda: link.read_loop(st)})

    def post(self, batch: WorkBatch) -> None:
        """Check and admit ``batch`` whole or not at all; to an idle pair, a batch of at most
        ``inline_bytes`` is executed here and now (see the module docstring), else by the worker."""
        n = len(batch)
        uniform = check_shape(batch, self.max_sge, self.qp_num)
        st, ex = self.pair_state, self._executor
        payload = (batch.length.item(0) if n == 1 else int(batch.length.sum())) if n else 0
        # One chunk (the worker's cut would find no boundary): a transfer's batch, usually.
        whole = (
            uniform and n <= IOV_MAX and int(batch.sge_start[n]) - int(batch.sge_start[0]) <= IOV_MAX
            and ex is not None and payload <= ex.round_bytes
        )  # fmt: skip
        with st.lock:
            self._admit_check_locked(n)
            if not n:
                return
            if ex is None or payload > self._tuning.inline_bytes:
                st.admit_locked(batch, whole)
                return
            if not st.admit_inline_locked(batch, whole):
                return  # queued for the worker (the pair is busy), or flushed (in ERR)
        assert ex is not None
        try:
            execute(st, ex, may_wait=False)
        except BaseException as exc:
            # As on the worker (``_guard``): the pair fails; the post stands (the batch was admitted).
            log.exception("cma qp %d: executing a batch on the posting thread failed", self.qp_num)
            st.fail(WcStatus.GENERAL_ERR, 0)
            if not isinstance(exc, Exception):
                raise

    def _shut(self) -> None:
        conn, link = self._conn, self.link
        self._port.expected.forget(self.token)
        if conn is not None:
            conn.shutdown()  # the initiator sees the end: its requests fail RETRY_EXC_ERR
        if link is not None:
            link.shutdown()
        self._join_threads()
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
        self.pair_state.passive_ended()
