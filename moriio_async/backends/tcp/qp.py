"""The TCP queue pair: the contract's face over its locked state (``pairstate.py``) and its threads.

``post`` checks a batch with array operations, admits it whole or not at all,
and rings the doorbell when the sender is idle (``sender.ring``); the sender
and receiver threads (``sender.py``, ``receiver.py``) take only the pair
state and the socket. The passive side's connection is served by the
backend's reactor thread, with every other accepted one (``listener.py``,
``responder.py``).

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

import functools
import secrets
import socket
from collections.abc import Callable

from ...core.auth import token_for
from ...errors import InvalidArgument
from ...status import Opcode
from ...work import WorkBatch
from ..base import BackendOptions, Endpoint, QpState
from ..soft.pair import check_shape
from ..soft.qp import MAX_SEND_WR, MAX_SGE, OnClose, SoftQueuePair
from .hooks import Hooks
from .listener import Listener, dial
from .pairstate import PairState
from .receiver import recv_loop
from .sender import INLINE_BYTES, ring, ring_locked, ring_one_locked, send_loop

__all__ = ["MAX_SEND_WR", "MAX_SGE", "TcpQueuePair"]

_WRITE = int(Opcode.RDMA_WRITE)


class TcpQueuePair(SoftQueuePair[PairState]):
    """A tcp pair over ``pair_state`` (its regions and hooks in it): dials, or is dialled through
    ``listener``, with a token that is random or derived from the control link's session key."""

    backend = "tcp"
    gathers_singles = True  # one sendmsg and one response per chunk, however many requests it holds

    def __init__(self, pair_state: PairState, listener: Listener, options: BackendOptions, on_close: OnClose) -> None:
        super().__init__(pair_state, options, on_close)
        self.nonce = secrets.token_bytes(16)
        self.remote: dict[str, object] = {}
        self._listener = listener
        self._answering = False
        self._session_key: bytes | None = None

    @property
    def hooks(self) -> Hooks | None:
        """This pair's fault-injection hooks (a passive pair's act on the requests it serves)."""
        return self.pair_state.hooks

    @hooks.setter
    def hooks(self, hooks: Hooks | None) -> None:
        self.pair_state.use_hooks(hooks)

    # -- the contract -----------------------------------------------------------------

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

    def _shown(self, remote: Endpoint) -> str:
        return _shown(remote)

    def _expect_dial_locked(self, remote: Endpoint) -> None:
        # The active pair will dial us with the token (derived, or ours).
        if self._session_key is not None:
            try:
                active_qp = int(remote["qp_num"])
            except (KeyError, ValueError, TypeError) as exc:
                raise InvalidArgument(f"malformed tcp endpoint {_shown(remote)}: {exc!r}") from exc
            self.token = self._derive(self.qp_num, active_qp, self.nonce)
        self.remote = dict(remote)
        self._listener.expected.expect(self.token, self.pair_state)

    def _before_dial_locked(self, remote: Endpoint) -> None:
        if self._answering:
            # The contract (backends/base.py): an answering pair never dials, whatever it is told.
            raise InvalidArgument(
                f"qp {self.qp_num} answers a peer's session and never dials; the endpoint asked it to"
            )
        self.remote = dict(remote)

    def _dial(self, remote: Endpoint) -> None:
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
        st = self.pair_state
        with st.lock:
            self._check_still_connectable_locked(sock.close)
            st.connected_locked(sock)
            self._start_threads({
                "send": functools.partial(self._loop, send_loop, sock),
                "recv": functools.partial(self._loop, recv_loop, sock),
            })  # fmt: skip

    def post(self, batch: WorkBatch) -> None:
        n = len(batch)
        check_shape(batch, self.max_sge, self.qp_num)
        st = self.pair_state
        with st.lock:
            state = self._admit_check_locked(n)
            if not n:
                return
            idle = st.may_ring_locked()
            rnd = None
            if n == 1 and idle and state == QpState.RTS and st.tx_lock.acquire(blocking=False):
                try:
                    rnd = ring_one_locked(st, batch)
                finally:
                    if rnd is None:
                        st.tx_lock.release()
            if rnd is None:
                if not st.admit_locked(batch):
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

    def _shut(self) -> None:
        st = self.pair_state
        self._listener.expected.forget(self.token)
        if st.responder is not None:
            # Not joined: close may run on the event loop; the reactor ends service once the socket is
            # shut (and a hook thread of its own, if any, is joined by the backend's close).
            st.responder.stop()
            return
        self._join_threads()
        if st.sock is not None:
            st.sock.close()

    def _loop(self, loop: Callable[[PairState, socket.socket], None], sock: socket.socket) -> None:
        loop(self.pair_state, sock)


def _shown(remote: Endpoint) -> str:
    """An endpoint for an error message, without its token."""
    return repr({k: v for k, v in dict(remote).items() if k != "token"})


def _payload(batch: WorkBatch) -> int:
    """The WRITE payload bytes of ``batch``."""
    if len(batch) == 1:
        return int(batch.length[0]) if batch.opcode[0] == _WRITE else 0
    return int(batch.length[batch.opcode == _WRITE].sum())
