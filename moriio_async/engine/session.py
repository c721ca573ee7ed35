"""``Session``: one local region, one remote region, one queue pair between them.

``read``/``write``/``batch_read``/``batch_write`` check everything, then
return a ``Transfer`` at once: they never block the loop and never fail for
lack of send-queue room. Bad input raises before anything is posted.

A transfer given a ``uid`` (``IOEngine.allocate_transfer_uid``, or the
caller's own) tells the target when it ends, success or failure (a ``done``
notice on the control link, after the data); the target pops the outcome
with ``pop_inbound_transfer_status``. A uid names one transfer in flight at a
time. Without a uid nothing is sent and nothing more is done per transfer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import final

import numpy as np
import numpy.typing as npt

from ..aio.channel import ChannelState, Job, QpChannel
from ..aio.router import CompletionRouter
from ..aio.transfer import Transfer
from ..backends.base import QueuePair
from ..control.peers import PeerTable
from ..core.plan import check_arrays, check_block, plan
from ..descriptors import MemoryDesc
from ..errors import EngineClosed, InvalidArgument, MoriioError, SessionClosed, StalePeer
from ..status import Access, Opcode, StatusCode
from .memory import LocalRegion
from .statistics import SessionStatistics
from .transports import Transport
from .uids import TransferUids

__all__ = ["Session"]

log = logging.getLogger("moriio_async")


@final
class Session:
    """Transfers between one local and one remote region, in order on one queue pair.

    Made by ``IOEngine.create_session``, which hands it what it works with: the
    engine's completion router (transfer ids, the outstanding set, routing of
    its pair's completions, drain), its peer table (to reconnect and to close
    its pair), and the set of open sessions, which it joins and leaves itself.
    """

    def __init__(
        self,
        local: LocalRegion,
        remote: MemoryDesc,
        qp: QueuePair,
        *,
        router: CompletionRouter,
        peers: PeerTable[Transport],
        uids: TransferUids,
        sessions: set[Session],
        max_wr_bytes: int,
        abort_timeout: float,
    ) -> None:
        self._router = router
        self._peers = peers
        self._uids = uids
        self._sessions = sessions
        self._max_wr_bytes = max_wr_bytes
        self._abort_timeout = abort_timeout
        self._local = local
        self.remote = remote
        self.channel = QpChannel(qp, on_failed_idle=self._on_failed_idle, on_post=router.kick)
        transport = peers.transport_of(qp)
        self.transport = transport.name
        """The backend this session's pair runs on ("cma", "verbs", "tcp", "mock"): for its whole life."""
        self._mr = local.mr_for(transport.tag)
        self._rkey = remote.rkey_for(transport.name)
        self.closed = False
        self.stale = False
        self._reconnect_task: asyncio.Task[None] | None = None
        # Both descriptors are immutable: decide once what each operation may do.
        self._denied = {
            Opcode.RDMA_READ: (
                "RDMA READ needs LOCAL_WRITE access on the local region"
                if not local.desc.access & Access.LOCAL_WRITE
                else f"remote region {remote.name!r} does not allow REMOTE_READ"
                if not remote.access & Access.REMOTE_READ
                else ""
            ),
            Opcode.RDMA_WRITE: (
                f"remote region {remote.name!r} does not allow REMOTE_WRITE"
                if not remote.access & Access.REMOTE_WRITE
                else ""
            ),
        }
        router.attach(self.channel)
        sessions.add(self)

    @property
    def local(self) -> MemoryDesc:
        return self._local.desc

    @property
    def peer(self) -> str:
        return self.remote.engine_key

    def __repr__(self) -> str:
        return (
            f"<Session {self.local.name or 'local'} -> {self.peer}/{self.remote.name} over {self.transport} "
            f"{self.channel.state}>"
        )

    # -- MoRI-IO's transfer calls -------------------------------------------------------------

    def read(self, local_offset: int, remote_offset: int, size: int, *, uid: int | None = None) -> Transfer:
        """RDMA READ ``size`` bytes from the remote region into the local one."""
        return self._submit_one(Opcode.RDMA_READ, local_offset, remote_offset, size, uid)

    def write(self, local_offset: int, remote_offset: int, size: int, *, uid: int | None = None) -> Transfer:
        """RDMA WRITE ``size`` bytes from the local region into the remote one."""
        return self._submit_one(Opcode.RDMA_WRITE, local_offset, remote_offset, size, uid)

    def batch_read(
        self,
        local_offsets: Sequence[int],
        remote_offsets: Sequence[int],
        sizes: Sequence[int],
        *,
        uid: int | None = None,
    ) -> Transfer:
        """Many blocks as one transfer; contiguous blocks merge into fewer work requests."""
        return self._submit(Opcode.RDMA_READ, local_offsets, remote_offsets, sizes, uid)

    def batch_write(
        self,
        local_offsets: Sequence[int],
        remote_offsets: Sequence[int],
        sizes: Sequence[int],
        *,
        uid: int | None = None,
    ) -> Transfer:
        return self._submit(Opcode.RDMA_WRITE, local_offsets, remote_offsets, sizes, uid)

    def alive(self) -> bool:
        """A transfer started now would go straight to a usable queue pair.

        False once the session or its engine closed, once the peer restarted
        (``stale``), while the pair is failed (the next transfer reconnects),
        and once the control link the pair was set up over closed (the peer
        died, or closed its end). MoRI-IO's ``Alive()`` always answers true.
        """
        return (
            not self.closed
            and not self.stale
            and not self._router.closed
            and self.channel.state == ChannelState.READY
            and self._peers.usable(self.channel.qp)
        )

    def _check_usable(self, opcode: Opcode) -> None:
        if self._router.closed:
            raise EngineClosed(f"engine {self._local.desc.engine_key!r} is closed")
        if self.closed:
            raise SessionClosed(f"{self!r} is closed")
        if not self._local.live:
            raise InvalidArgument("the session's local region was deregistered")
        denied = self._denied[opcode]
        if denied:
            raise InvalidArgument(denied)

    def _submit_one(self, opcode: Opcode, lo: int, ro: int, sz: int, uid: int | None) -> Transfer:
        """The single read/write: scalar checks and a one-request job, no arrays to plan."""
        self._check_usable(opcode)
        remote = self.remote
        lo, ro, sz = check_block(lo, ro, sz, self._local.desc.length, remote.length)
        if sz > self._max_wr_bytes:
            return self._submit(opcode, [lo], [ro], [sz], uid)
        if uid is not None:
            uid = self._uids.claim(uid)  # the last check: a refused uid posts nothing
        transfer = self._new_transfer(opcode, (lo,), (ro,), (sz,), uid)
        mr = self._mr
        job = Job.single(
            transfer, opcode, local_addr=mr.addr + lo, lkey=mr.lkey, remote_addr=remote.addr + ro, rkey=self._rkey,
            size=sz,
        )  # fmt: skip
        return self._post(transfer, job)

    def _submit(
        self, opcode: Opcode, lo: Sequence[int], ro: Sequence[int], sz: Sequence[int], uid: int | None
    ) -> Transfer:
        self._check_usable(opcode)
        remote = self.remote
        lo_a, ro_a, sz_a = check_arrays(lo, ro, sz, self._local.desc.length, remote.length)
        qp = self.channel.qp
        the_plan = plan(lo_a, ro_a, sz_a, max_sge=qp.max_sge, max_wr_bytes=self._max_wr_bytes)
        if uid is not None:
            uid = self._uids.claim(uid)
        # check_arrays hands back a caller's int64 array as it is (planning copies what it keeps);
        # the transfer's record is copied, so a caller refilling its arrays for the next batch
        # does not rewrite what this one reports.
        transfer = self._new_transfer(opcode, _owned(lo_a, lo), _owned(ro_a, ro), _owned(sz_a, sz), uid)
        mr = self._mr
        job = Job(
            transfer, the_plan, opcode, local_addr=mr.addr, lkey=mr.lkey, remote_addr=remote.addr, rkey=self._rkey
        )
        return self._post(transfer, job)

    def _new_transfer(
        self,
        opcode: Opcode,
        lo: Sequence[int] | npt.NDArray[np.int64],
        ro: Sequence[int] | npt.NDArray[np.int64],
        sz: Sequence[int] | npt.NDArray[np.int64],
        uid: int | None,
    ) -> Transfer:
        router = self._router
        transfer = Transfer(
            router.loop, router.next_transfer_id(), opcode, self.peer, lo, ro, sz, drainer=router, uid=uid
        )
        if uid is not None:
            transfer.add_done_callback(self._announce)
        return transfer

    def _announce(self, transfer: Transfer) -> None:
        """A transfer with a uid ended: free its uid, then tell the target how it ended."""
        assert transfer.uid is not None
        self._uids.release(transfer.uid)
        remote = self.remote
        self._peers.post_done(remote.engine_key, remote.incarnation, transfer.uid, transfer.code)

    def _post(self, transfer: Transfer, job: Job) -> Transfer:
        self._local.pin()
        self._router.track(transfer, self._local)
        if self.stale:
            transfer.start(len(job))
            transfer.fail(StatusCode.ERR_BAD_STATE, self._stale_message(), hint=_STALE_HINT)
            return transfer
        self.channel.submit(job)
        return transfer

    # -- failure and recovery ------------------------------------------------------------------

    def _on_failed_idle(self, channel: QpChannel) -> None:
        """The pair failed earlier and has drained; new requests wait for a fresh pair."""
        if self._reconnect_task is None and not self.closed:
            self._reconnect_task = self._router.loop.create_task(self._reconnect())

    async def _reconnect(self) -> None:
        old = self.channel.qp
        try:
            qp = await self._peers.open_qp(self.remote, self.transport)  # queued requests name its keys
        except StalePeer as exc:
            self.stale = True
            self._fail_waiting(StatusCode.ERR_BAD_STATE, f"{self._stale_message()}: {exc}", _STALE_HINT)
        except (MoriioError, OSError) as exc:
            self._fail_waiting(
                StatusCode.ERR_RDMA_OP,
                f"reconnecting to {self.peer} failed: {exc}",
                "the peer is unreachable; later transfers on this session try to reconnect again",
            )
        else:
            if self.closed:
                self._peers.close_qp(qp)
            else:
                self._router.detach(self.channel)
                self._peers.close_qp(old)
                self.channel.replace_qp(qp)
                self._router.attach(self.channel)
                log.info("session to %s reconnected on a new %s queue pair %d", self.peer, self.transport, qp.qp_num)
        finally:
            self._reconnect_task = None
        if self.channel.state == ChannelState.FAILED and self.channel.waiting and not self.closed:
            self._on_failed_idle(self.channel)

    def _fail_waiting(self, code: StatusCode, message: str, hint: str) -> None:
        self.channel.abandon_waiting(code, message, hint)

    def _stale_message(self) -> str:
        return (
            f"peer {self.peer} restarted: the remote region {self.remote.name!r} belongs to its "
            f"earlier incarnation {self.remote.incarnation:#x}"
        )

    async def abort(self, timeout: float | None = None) -> None:
        """Move the queue pair to the error state and wait until every transfer on it has ended.

        In-flight requests end with WR_FLUSH_ERR as the NIC reports them; if it
        reports nothing within ``timeout`` (default ``abort_timeout``), they are
        declared flushed. Afterwards the session holds no request and no pin;
        the next transfer reconnects on a new queue pair.
        """
        # Even an idle pair is failed on purpose: the caller aborts because it distrusts the
        # connection (a peer that died silently leaves an idle pair looking healthy).
        self.channel.begin_abort()
        self._router.drain()
        try:
            async with asyncio.timeout(timeout if timeout is not None else self._abort_timeout):
                await self.channel.wait_idle()
        except TimeoutError:
            log.warning("abort of %r: no flush completions; declaring %d flushed", self, self.channel.in_flight)
            self.channel.force_fail_in_flight()
            self.channel.fail_waiting()

    async def drain(self, timeout: float | None = None) -> None:
        """Wait until no transfer on this session is in flight or waiting to post (``TimeoutError`` leaves
        them running). With ``close`` after it: a close that aborts nothing that was started."""
        async with asyncio.timeout(timeout):
            await self.channel.wait_idle()

    async def close(self) -> None:
        """Abort what is in flight, then destroy the queue pair. Idempotent."""
        if self.closed:
            return
        await self.abort()
        self.closed = True
        if self._reconnect_task is not None:
            self._reconnect_task.cancel()
        self._sessions.discard(self)
        self._router.detach(self.channel)
        self._peers.close_qp(self.channel.qp)

    def statistics(self) -> SessionStatistics:
        ch = self.channel
        return SessionStatistics(
            ch.state, self.transport, ch.qp_num, ch.in_flight, ch.waiting, ch.posted, ch.max_in_flight, ch.sendq.depth
        )


_STALE_HINT = "connect() to the peer again and create a new session with its new MemoryDesc"


def _owned(checked: npt.NDArray[np.int64], given: object) -> npt.NDArray[np.int64]:
    """``checked``, copied when it is the caller's own array (``check_arrays`` did not convert it)."""
    return checked.copy() if checked is given else checked
