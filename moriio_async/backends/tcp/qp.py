"""The TCP queue pair: the contract's face over its locked state (``pairstate.py``) and its threads.

``post`` checks a batch with array operations, admits it whole or not at all,
and rings the doorbell when the sender is idle (``sender.ring``); the sender
and receiver threads (``sender.py``, ``receiver.py``) take only the pair
state and the socket. The passive side's connection is served by the
listener's thread for it (``listener.py``, ``responder.py``).

Tokens: with a session key (``bind_session``: the key of the authenticated
control link the pair is set up over), the passive pair's endpoint carries a
fresh nonce instead of a token, and both sides compute the token as
``core.auth.token_for(session_key, "tcp-data/<passive qp>/<active qp>/<nonce>", 0)``;
it never crosses the control link, and the listener accepts it once. Without
a session key (no shared secret), the token is 16 random bytes in the
endpoint, as before. An answering pair never dials: given an endpoint that
asks it to (``accepting``), its ``connect`` refuses.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
from collections.abc import Callable

from ...core.auth import token_for
from ...errors import InvalidArgument
from ...status import Opcode, WcStatus
from ...work import WorkBatch
from ..base import BackendOptions, Endpoint, QpState, QueuePair, SendQueueFull
from ..softcq import SoftCompletionQueue
from ..softpair import check_shape
from .hooks import Hooks
from .listener import Listener, dial
from .pairstate import PairState
from .receiver import recv_loop
from .regions import RegionTable
from .sender import INLINE_BYTES, ring, ring_locked, ring_one_locked, send_loop

__all__ = ["MAX_SEND_WR", "MAX_SGE", "TcpQueuePair"]

log = logging.getLogger("moriio_async.tcp")

MAX_SEND_WR = 1 << 16
MAX_SGE = 256

_WRITE = int(Opcode.RDMA_WRITE)


class TcpQueuePair(QueuePair):
    def __init__(
        self,
        qp_num: int,
        cq: SoftCompletionQueue,
        regions: RegionTable,
        listener: Listener,
        options: BackendOptions,
        hooks: Hooks | None,
        on_close: Callable[[TcpQueuePair], None],
    ) -> None:
        self.qp_num = qp_num
        self.max_send_wr = max(1, min(options.sq_depth, MAX_SEND_WR))
        self.max_sge = max(1, min(options.max_sge, MAX_SGE))
        self.token = secrets.token_bytes(16)
        """What the active side presents in its hello: random here; derived once a session key is bound."""
        self.nonce = secrets.token_bytes(16)
        self.remote: dict[str, object] = {}
        self.pair_state = PairState(qp_num, cq, regions, hooks)
        self.pair_state.retry_timeout = options.retry_timeout
        """The locked state the NIC threads share (public for inspection and tests)."""
        self._listener = listener
        self._options = options
        self._on_close = on_close
        self._passive = False
        self._answering = False
        self._session_key: bytes | None = None
        self._threads: list[threading.Thread] = []

    @property
    def hooks(self) -> Hooks | None:
        """This pair's fault-injection hooks (a passive pair's act on the requests it serves)."""
        return self.pair_state.hooks

    @hooks.setter
    def hooks(self, hooks: Hooks | None) -> None:
        self.pair_state.hooks = hooks

    # -- the contract -----------------------------------------------------------------

    @property
    def state(self) -> QpState:
        return self.pair_state.state

    def bind_session(self, session_key: bytes | None, *, answering: bool) -> None:
        with self.pair_state.lock:
            if self.pair_state.state != QpState.INIT:
                raise InvalidArgument(f"bind_session needs a queue pair in INIT (qp {self.qp_num})")
            self._session_key = session_key
            self._answering = answering

    def endpoint(self) -> Endpoint:
        secured = self._session_key is not None
        return {
            "backend": "tcp",
            "host": self._listener.host,
            "port": self._listener.port,
            "qp_num": self.qp_num,
            # With a session key the token is derived, never sent: the peer gets the nonce it derives from.
            **({"nonce": self.nonce.hex()} if secured else {"token": self.token.hex()}),
            # True once connect() made this the passive side: the peer then dials it.
            "accepting": self._passive,
        }

    def _derive(self, passive_qp: int, active_qp: int, nonce: bytes) -> bytes:
        assert self._session_key is not None
        return token_for(self._session_key, f"tcp-data/{passive_qp}/{active_qp}/{nonce.hex()}", 0)

    def connect(self, remote: Endpoint) -> None:
        if remote.get("backend") != "tcp":
            raise InvalidArgument(f"not a tcp queue-pair endpoint: {_shown(remote)}")
        st = self.pair_state
        with st.lock:
            if st.closed or st.state != QpState.INIT:
                raise InvalidArgument(f"connect needs a queue pair in INIT (qp {self.qp_num} is {st.state})")
            if not remote.get("accepting"):
                # Passive side: the active pair will dial us with the token (derived, or ours).
                if self._session_key is not None:
                    try:
                        active_qp = int(remote["qp_num"])
                    except (KeyError, ValueError, TypeError) as exc:
                        raise InvalidArgument(f"malformed tcp endpoint {_shown(remote)}: {exc!r}") from exc
                    self.token = self._derive(self.qp_num, active_qp, self.nonce)
                self.remote = dict(remote)
                self._passive = True
                st.state = QpState.RTS
                self._listener.expect(self.token, st)
                return
            if self._answering:
                # The contract (backends/base.py): an answering pair never dials, whatever it is told.
                raise InvalidArgument(
                    f"qp {self.qp_num} answers a peer's session and never dials; the endpoint asked it to"
                )
            self.remote = dict(remote)
        assert not self._answering
        try:
            host, port, peer_qp = str(remote["host"]), int(remote["port"]), int(remote["qp_num"])
            if self._session_key is not None:
                token = self._derive(peer_qp, self.qp_num, bytes.fromhex(str(remote["nonce"])))
            else:
                token = bytes.fromhex(str(remote["token"]))
        except (KeyError, ValueError, TypeError) as exc:
            raise InvalidArgument(
                f"malformed tcp endpoint {_shown(remote)}: {exc!r}",
                hint="both engines must run with the same shared secret setting and moriio_async version",
            ) from exc
        sock = dial(host, port, token, self.qp_num, self._options)
        with st.lock:
            if st.closed or st.state != QpState.INIT:
                sock.close()
                raise InvalidArgument(f"qp {self.qp_num} was closed while connecting")
            st.sock = sock
            st.state = QpState.RTS
            self._threads = self._start_threads(sock)

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
            if not n:
                return
            idle = not st.pending and st.tx_pending is None and not st.send_stopped and st.hooks is None
            rnd = None
            if n == 1 and idle and state == QpState.RTS and st.tx_lock.acquire(blocking=False):
                try:
                    rnd = ring_one_locked(st, batch)
                finally:
                    if rnd is None:
                        st.tx_lock.release()
            if rnd is None:
                st.admit_locked(batch)
                if st.state != QpState.RTS:
                    return  # flushed at once
                if not (idle and _payload(batch) <= INLINE_BYTES and st.tx_lock.acquire(blocking=False)):
                    st.send_cv.notify()
                    return
                try:
                    rnd = ring_locked(st)
                except BaseException:
                    st.tx_lock.release()
                    raise
            sock = st.sock
        # The write runs under tx_lock only (it orders the socket's writers); the pair lock is free
        # meanwhile, so the receiver completing responses never waits for this socket call.
        try:
            if rnd is not None:
                assert sock is not None
                ring(st, sock, rnd)
        finally:
            st.tx_lock.release()
        if st.pending:  # posted by another thread meanwhile, which found tx_lock taken
            with st.lock:
                st.send_cv.notify()

    def to_error(self) -> None:
        st = self.pair_state
        with st.lock:
            st.fail_locked(WcStatus.WR_FLUSH_ERR, 0)

    def close(self) -> None:
        st = self.pair_state
        with st.lock:
            if st.closed:
                return
            st.closed = True
            st.fail_locked(WcStatus.WR_FLUSH_ERR, 0)
            sock, responder = st.sock, st.responder
        self._listener.forget(self.token)
        self._on_close(self)
        if responder is not None:
            # Not joined: close may run on the event loop, and the responder's thread ends on its own
            # once its socket is shut (the listener keeps it, and the backend's close joins it).
            responder.stop()
            return
        current = threading.current_thread()
        for t in self._threads:
            if t is not current:
                t.join()
        if sock is not None:
            sock.close()

    # -- threads ------------------------------------------------------------------------

    def _start_threads(self, sock: socket.socket) -> list[threading.Thread]:
        threads = [
            threading.Thread(target=self._guard, args=(send_loop, sock), name=f"moriio-tcp-send-{self.qp_num}"),
            threading.Thread(target=self._guard, args=(recv_loop, sock), name=f"moriio-tcp-recv-{self.qp_num}"),
        ]
        for t in threads:
            t.daemon = True
            t.start()
        return threads

    def _guard(self, loop: Callable[[PairState, socket.socket], None], sock: socket.socket) -> None:
        """Run a NIC loop; an unexpected error becomes completions, never a thread exception."""
        try:
            loop(self.pair_state, sock)
        except BaseException:
            log.exception("tcp qp %d: NIC thread failed", self.qp_num)
            self.pair_state.fail(WcStatus.GENERAL_ERR, 0)


def _shown(remote: Endpoint) -> str:
    """An endpoint for an error message, without its token."""
    return repr({k: v for k, v in dict(remote).items() if k != "token"})


def _payload(batch: WorkBatch) -> int:
    """The WRITE payload bytes of ``batch``."""
    if len(batch) == 1:
        return int(batch.length[0]) if batch.opcode[0] == _WRITE else 0
    return int(batch.length[batch.opcode == _WRITE].sum())
