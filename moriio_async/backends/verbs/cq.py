"""The verbs completion queue: a CQ, its completion channel, and an eventfd, behind one epoll fd.

Why an epoll fd: the contract says a fatal condition learnt off the event
loop (a device event seen by the watcher thread, a pair declared dead) is
reported as completions through this queue. The hardware will not write
those, so the backend makes them up (see ``ledger.py``) and must also wake the
reader. ``fileno()`` is therefore an epoll instance holding two fds, both
level-triggered: the completion channel (readable while a CQ event is
pending) and an eventfd the backend writes whenever it queues a synthetic
completion or a kill request. asyncio watches the epoll fd like any other;
it is readable while either member is.

The reader's loop (get_event, req_notify, poll until empty) misses nothing:
``get_event`` drains both members, and the writer queues its request under
the lock *before* writing the eventfd, so a write after the reader's last
poll leaves the fd readable again.

``poll`` returns hardware completions first, then applies kill requests (only
once the CQ is drained, so the hardware's own completions win while they
exist), then synthetic completions of pairs with nothing left in hardware.
"""

from __future__ import annotations

import logging
import os
import select
import threading
from collections.abc import Callable

from ...status import WcStatus
from ...work import WorkCompletion
from ..base import CompletionQueue
from ._pyverbs import Context, CqHandle
from .ledger import SendLedger
from .values import VerbsError

__all__ = ["VerbsCompletionQueue"]

log = logging.getLogger("moriio_async.verbs")
_warned_no_fd = False


class VerbsCompletionQueue(CompletionQueue):
    def __init__(self, ctx: Context, depth: int) -> None:
        global _warned_no_fd
        self.handle = CqHandle(ctx, depth)
        self.ledgers: dict[int, SendLedger] = {}
        """qp_num -> ledger, for every pair whose send completions come here."""
        self.fault_hooks: dict[int, Callable[[], None]] = {}
        """qp_num -> a fault plan's check, run at every poll (``faults.py``; tests only)."""
        self._lock = threading.Lock()
        self._kills: list[tuple[int, WcStatus]] = []
        self._eventfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll: select.epoll | None = None
        if self.handle.fd >= 0:
            self._epoll = select.epoll()
            os.set_blocking(self._epoll.fileno(), False)
            self._epoll.register(self.handle.fd, select.EPOLLIN)
            self._epoll.register(self._eventfd, select.EPOLLIN)
        elif not _warned_no_fd:
            _warned_no_fd = True
            log.warning(
                "pyverbs has no CompChannel.fd (rdma-core < 57): completion queues report fileno() -1 "
                "and the runtime polls them; upgrade pyverbs/rdma-core to >= 57 for event-driven wakeups"
            )
        self._closed = False

    # -- the contract -----------------------------------------------------------------------

    def fileno(self) -> int:
        return -1 if self._epoll is None else self._epoll.fileno()

    def req_notify(self) -> None:
        self.handle.req_notify()

    def get_event(self) -> bool:
        got = self.handle.get_events() > 0
        try:
            os.eventfd_read(self._eventfd)
            got = True
        except BlockingIOError:
            pass
        return got

    def poll(self, max_entries: int = 64) -> list[WorkCompletion]:
        out: list[WorkCompletion] = []
        drained = True
        try:
            raw = self.handle.poll(max_entries)
        except VerbsError as exc:
            # A broken CQ (overrun) will not deliver again: every pair on it fails now.
            log.error("poll on a broken CQ (%s): failing every queue pair on it", exc)
            raw = []
            for ledger in self.ledgers.values():
                ledger.kill(WcStatus.FATAL_ERR)
        drained = len(raw) < max_entries
        for rc in raw:
            owner = self.ledgers.get(rc.qp_num)
            if owner is None:
                continue
            wc = owner.complete(rc.wr_id, WcStatus.parse(rc.status), rc.vendor_err, rc.byte_len)
            if wc is not None:
                out.append(wc)
        if drained:
            self._apply_kills()
        for hook in list(self.fault_hooks.values()):
            hook()
        for ledger in list(self.ledgers.values()):
            if len(out) >= max_entries:
                break
            if ledger.synth_ready:
                out.extend(ledger.take_synth(max_entries - len(out)))
            if ledger.closed and ledger.held == 0:
                del self.ledgers[ledger.qp_num]
                self.fault_hooks.pop(ledger.qp_num, None)
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._epoll is not None:
            self._epoll.close()
        os.close(self._eventfd)
        self.handle.close()

    # -- for the backend ----------------------------------------------------------------------

    def wake(self) -> None:
        """Make ``fileno()`` readable: synthetic completions are waiting (any thread)."""
        if not self._closed:
            os.eventfd_write(self._eventfd, 1)

    def request_kill(self, qp_num: int, status: WcStatus = WcStatus.FATAL_ERR) -> None:
        """From any thread: the pair's outstanding requests fail at the next poll."""
        with self._lock:
            self._kills.append((qp_num, status))
        self.wake()

    def _apply_kills(self) -> None:
        with self._lock:
            kills, self._kills = self._kills, []
        for qp_num, status in kills:
            ledger = self.ledgers.get(qp_num)
            if ledger is not None:
                ledger.kill(status)
