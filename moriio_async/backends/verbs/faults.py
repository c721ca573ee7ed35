"""Fault plans on verbs: applied where this backend posts requests and makes completions.

A verbs target never sees a request (RDMA is one-sided: the responder is the
NIC, here the rxe kernel module), so unlike the TCP hooks every rule acts at
the initiator's queue pairs, as the initiator would observe it:

``status``
    Requests before it are posted (the last of them signaled, so their end is
    known); once they have all completed, it completes with the status without
    being posted, the pair goes to the error state and every later request
    flushes.
``drop``
    The same with RETRY_EXC_ERR, as a cut cable after the earlier responses
    arrived. (A real cut can also catch an earlier request in flight.)
``delay``
    The request and everything after it on the pair wait ``seconds`` before
    being posted, so its completion and the later ones come that much late.
``stall``
    The target "stops answering" at the request: like a delay of ``seconds``;
    when ``seconds`` is 0 (until released) or longer than the backend's
    ``retry_timeout``, the request instead fails with RETRY_EXC_ERR after
    ``retry_timeout`` and the rest flush, as a silent peer makes the transport
    give up.
``kill``
    Refused: no seam of this backend runs in the target process.

Pairs and requests are counted as in ``core/faultplan.py``: pairs in the order
of their first post, requests per pair in posting order. Set it with
``VerbsOptions(fault_plan=plan)`` (a ``FaultPlan``, its dict, or its JSON)
on the initiator's engine. Everything runs on the event-loop thread, except a
timer thread per wait that only wakes the completion queue.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ...core.faultplan import Action, Applied, FaultPlan, FaultRule
from ...errors import InvalidArgument
from ...status import WcStatus
from ...work import WorkBatch
from ..described import FaultPlanFacts

__all__ = ["PairFaults", "VerbsFaultSeam"]

Part = tuple[WorkBatch, int]
"""Requests ``start:`` of a batch."""


class VerbsFaultSeam:
    """One backend's fault plan: which rule applies to which request, and what fired."""

    def __init__(self, plan: FaultPlan, retry_timeout: float) -> None:
        if plan.kills:
            raise InvalidArgument(
                "a fault plan for the verbs backend cannot kill the target: one-sided verbs run nothing in the "
                "target process to do it (the two-guest tests kill a real peer instead)"
            )
        self.plan = plan
        self.retry_timeout = retry_timeout
        self._first = [r for r in plan.rules if r.action in (Action.STATUS, Action.DROP)]
        self._waits = [r for r in plan.rules if r.action in (Action.DELAY, Action.STALL)]
        self._pairs: dict[int, int] = {}
        self._lock = threading.Lock()
        self._applied: list[Applied] = []

    def pair_index(self, qp_num: int) -> int:
        with self._lock:
            return self._pairs.setdefault(qp_num, len(self._pairs))

    def rule_at(self, qp: int, wr: int, skip: frozenset[FaultRule]) -> FaultRule | None:
        """The rule for request ``wr`` of pair ``qp``: a status or drop first (they act before sending)."""
        for rule in self._first:
            if rule.matches(qp, wr):
                return rule
        return next((r for r in self._waits if r not in skip and r.matches(qp, wr)), None)

    def record(self, rule: FaultRule, qp: int, wr: int) -> None:
        detail = {
            Action.STATUS: rule.status.name,
            Action.DELAY: f"{rule.seconds:g}s",
            Action.STALL: f"{rule.seconds:g}s" if rule.seconds else "until released",
        }.get(rule.action, "")
        with self._lock:
            self._applied.append(Applied(rule.action, qp, wr, detail))

    @property
    def applied(self) -> list[Applied]:
        with self._lock:
            return list(self._applied)

    def describe(self) -> FaultPlanFacts:
        return FaultPlanFacts(rules=tuple(r.describe() for r in self.plan.rules), applied=tuple(self.applied))


@dataclass(slots=True)
class _Wait:
    rule: FaultRule
    until: float | None
    """Monotonic time the wait ends (None: it ends once the pair's hardware requests completed)."""
    fail: WcStatus | None
    """When it ends: fail the waiting requests with this status (None: post them)."""


class PairFaults:
    """The plan at one queue pair: requests not yet posted, and what they wait for (event-loop thread).

    ``post`` posts a part on the device (the backend's normal path); ``fail``
    makes the parts' requests complete without the device (the first with the
    status, the rest flushed) and moves the pair to the error state;
    ``outstanding`` says how many posted requests the device has not completed;
    ``dead`` whether the backend gave up on the pair.
    """

    def __init__(
        self,
        seam: VerbsFaultSeam,
        qp_num: int,
        *,
        post: Callable[[WorkBatch], None],
        fail: Callable[[list[Part], WcStatus], None],
        outstanding: Callable[[], int],
        dead: Callable[[], bool],
        wake: Callable[[], None],
    ) -> None:
        self.seam = seam
        self.qp_num = qp_num
        self.pair: int | None = None
        self._post, self._fail, self._outstanding, self._dead, self._wake = post, fail, outstanding, dead, wake
        self._pending: deque[tuple[WorkBatch, int, int]] = deque()
        """(batch, start, pair index of the batch's request 0): not yet posted, in order."""
        self.waiting = 0
        """Requests in ``_pending`` (they hold send-queue slots)."""
        self._next = 0
        self._wait: _Wait | None = None
        self._fired: tuple[int, frozenset[FaultRule]] = (-1, frozenset())
        """Waits already served at one request (so a released request goes on)."""
        self._timer: threading.Timer | None = None
        self._aborted = False
        """The pair is in the error state (``abort``, or this seam failed it): from now on requests go
        to the device at once, which flushes them in order, as a real pair in ERR does; no rule holds
        them (a delay would make each flush wait, and a wait over them end in timeouts)."""

    def submit(self, batch: WorkBatch) -> None:
        if self.pair is None:
            self.pair = self.seam.pair_index(self.qp_num)
        self._pending.append((batch, 0, self._next))
        self._next += len(batch)
        self.waiting += len(batch)
        self.run()

    def run(self) -> None:
        """Post what the plan lets through now; stop at the next rule."""
        assert self.pair is not None or not self._pending
        if self._aborted and self._wait is None:
            while self._pending:
                batch, start, _base = self._pending.popleft()
                self._send(batch, start, len(batch), signal_last=False)
            return
        while self._pending and self._wait is None:
            batch, start, base = self._pending[0]
            i, rule = start, None
            while i < len(batch):
                fired_at, fired = self._fired
                rule = self.seam.rule_at(self.pair or 0, base + i, fired if fired_at == base + i else frozenset())
                if rule is not None:
                    break
                i += 1
            if i > start:
                self._send(batch, start, i, signal_last=rule is not None)
            if rule is None:
                self._pending.popleft()
                continue
            self._pending[0] = (batch, i, base)
            self.seam.record(rule, self.pair or 0, base + i)
            self._start_wait(rule, base + i)

    def abort(self) -> None:
        """The pair is moved to the error state (any thread): what waits here flushes at the next poll."""
        self._aborted = True
        self._wake()

    def due(self) -> None:
        """Called at every poll of the pair's completion queue: end a wait whose time has come."""
        wait = self._wait
        if wait is not None and (self._aborted or self._dead()):
            self.fail_all()  # what waits here flushes, after the device's own completions
            return
        if wait is None or (wait.until is not None and time.monotonic() < wait.until):
            return
        if wait.fail is None:
            self._wait = None
            self.run()
        elif self._outstanding() == 0:
            self._wait = None
            self.fail_all(wait.fail)
        elif wait.until is not None:
            wait.until = None  # the time is up: fail once the earlier requests are done

    def fail_all(self, status: WcStatus = WcStatus.WR_FLUSH_ERR) -> None:
        """Every waiting request completes without the device: the first with ``status``, then flushes."""
        self._aborted = True  # ``_fail`` moves the pair to ERR
        parts = [(batch, start) for batch, start, _ in self._pending]
        self._pending.clear()
        self.waiting = 0
        self._wait = None
        self._cancel_timer()
        if parts:
            self._fail(parts, status)

    def close(self) -> None:
        self._cancel_timer()

    # -- inside --------------------------------------------------------------------------

    def _send(self, batch: WorkBatch, start: int, stop: int, *, signal_last: bool) -> None:
        part = batch.slice(start, stop)
        if signal_last and not part.signaled[-1]:
            # The wait that follows needs to know when these are done: the last one reports it.
            signaled = part.signaled.copy()
            signaled[-1] = True
            part = WorkBatch(part.wr_id, part.opcode, part.remote_addr, part.rkey, part.length, signaled,
                             part.sge_start, part.sge_addr, part.sge_length, part.sge_lkey)  # fmt: skip
        self.waiting -= stop - start
        self._post(part)

    def _start_wait(self, rule: FaultRule, index: int) -> None:
        now = time.monotonic()
        if rule.action is Action.STATUS:
            self._wait = _Wait(rule, None, rule.status)
        elif rule.action is Action.DROP:
            self._wait = _Wait(rule, None, WcStatus.RETRY_EXC_ERR)
        else:
            retry = self.seam.retry_timeout
            gives_up = rule.action is Action.STALL and (rule.seconds == 0 or rule.seconds > retry)
            seconds = retry if gives_up else rule.seconds
            self._wait = _Wait(rule, now + seconds, WcStatus.RETRY_EXC_ERR if gives_up else None)
            fired_at, fired = self._fired
            self._fired = (index, (fired if fired_at == index else frozenset()) | {rule})
            self._cancel_timer()
            self._timer = threading.Timer(max(0.0, seconds), self._wake)
            self._timer.daemon = True
            self._timer.start()
        self.due()  # a status or drop with nothing outstanding ends at once

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
