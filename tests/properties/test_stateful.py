"""A state machine over one initiator engine and a peer that can die: every rule, then every invariant.

Rules post reads and writes on several sessions, make the held mock NIC run,
fail or lose requests, wait with deadlines, abort and open sessions,
deregister regions on either side and restart the peer under the same key
and port. After every step the invariants check what must hold whatever
happened: each transfer ends once and keeps its first terminal state, a
session's transfers end in posting order, nothing succeeds on a queue pair
after a failure there, and the engine's counts of outstanding transfers and
pinned memory are exactly what is still running.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import pytest
import uvloop
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from moriio_async import (
    InvalidArgument,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    MemoryInUse,
    MockOptions,
    Session,
    SessionClosed,
    Transfer,
    TransferError,
    waiting_for_transfer_complete,
)

from ..engine.conftest import make_pair
from .conftest import needs_held_mock
from .model import BLOCK, NicStep, held_qp, nic_steps, settle

pytestmark = needs_held_mock

R = TypeVar("R")
SIZE = 1 << 16
CONFIG: dict[str, Any] = {"mock": MockOptions(hold=True), "sq_depth": 4, "abort_timeout": 2.0, "control_timeout": 2.0}
BOUND = 0.5
"""Seconds past its deadline a wait may return (real clock)."""


@dataclass(eq=False)
class Local:
    desc: MemoryDesc
    buf: np.ndarray
    live: bool = True


@dataclass(eq=False)
class Tracked:
    transfer: Transfer
    session: int
    local: Local
    ends: int = 0
    first: tuple[int, str] | None = None
    qp: int | None = None


@dataclass(eq=False)
class SessionRecord:
    session: Session
    transfers: list[Tracked] = field(default_factory=list)


class TransferMachine(RuleBasedStateMachine):
    new_loop: Callable[[], asyncio.AbstractEventLoop] = staticmethod(asyncio.new_event_loop)

    def __init__(self) -> None:
        super().__init__()
        self.loop = self.new_loop()
        self.loop_errors: list[dict[str, Any]] = []
        self.loop.set_exception_handler(lambda _loop, context: self.loop_errors.append(context))
        self.a, self.b, pair = self.run(make_pair("mock", size=SIZE, **CONFIG))
        self.port = int(self.b.address.rsplit(":", 1)[1])
        self.locals = [Local(pair.desc_a, pair.buf_a)]
        self.remote: MemoryDesc | None = pair.session.remote
        self.sessions = [SessionRecord(pair.session)]
        self.tracked: dict[int, Tracked] = {}
        self.failed_qps: set[int] = set()
        self.violations: list[str] = []

    def run(self, coro: Coroutine[Any, Any, R]) -> R:
        return self.loop.run_until_complete(coro)

    def open_sessions(self) -> list[SessionRecord]:
        return [s for s in self.sessions if not s.session.closed]

    # -- rules ------------------------------------------------------------------------------

    @precondition(lambda self: self.open_sessions())
    @rule(which=st.integers(0, 7), read=st.booleans(), blocks=st.integers(1, 3), at=st.integers(0, 60))
    def post(self, which: int, read: bool, blocks: int, at: int) -> None:
        rec = self.open_sessions()[which % len(self.open_sessions())]
        offs = [(at + 2 * j) * BLOCK for j in range(blocks)]
        s = rec.session
        local = next(loc for loc in self.locals if loc.desc == s.local)
        try:
            t = s.batch_read(offs, offs, [BLOCK] * blocks) if read else s.batch_write(offs, offs, [BLOCK] * blocks)
        except (InvalidArgument, SessionClosed):
            assert not local.live, "a post on a live session and region was refused"
            return
        tr = Tracked(t, self.sessions.index(rec), local)
        rec.transfers.append(tr)
        self.tracked[t.id] = tr
        t.add_done_callback(lambda t: self.ended(t))

    def ended(self, t: Transfer) -> None:
        tr = self.tracked[t.id]
        tr.ends += 1
        if tr.ends > 1:
            self.violations.append(f"transfer {t.id} ended twice")
        tr.first = (t.Code(), t.Message())
        rec = self.sessions[tr.session]
        earlier = rec.transfers[: rec.transfers.index(tr)]
        if any(not e.transfer.done() for e in earlier):
            self.violations.append(f"transfer {t.id} ended before an earlier one on its session")
        err = t.error()
        tr.qp = err.qp_num if err is not None else rec.session.channel.qp_num
        if t.Succeeded() and tr.qp in self.failed_qps:
            self.violations.append(f"transfer {t.id} succeeded on qp {tr.qp} after a failure there")
        if err is not None and err.wc_status is not None and tr.qp is not None:
            self.failed_qps.add(tr.qp)

    @precondition(lambda self: self.open_sessions())
    @rule(which=st.integers(0, 7), step=nic_steps)
    def nic(self, which: int, step: NicStep) -> None:
        rec = self.open_sessions()[which % len(self.open_sessions())]
        step.apply(held_qp(rec.session))
        self.run(settle())

    @rule(rounds=st.integers(1, 5))
    def let_time_pass(self, rounds: int) -> None:
        async def go() -> None:
            for _ in range(rounds):
                await asyncio.sleep(0.002)

        self.run(go())

    @precondition(lambda self: self.tracked)
    @rule(timeout=st.floats(0, 0.03), fail_fast=st.booleans(), pick=st.sets(st.integers(0, 200), max_size=8))
    def wait(self, timeout: float, fail_fast: bool, pick: set[int]) -> None:
        ids = sorted(self.tracked)
        chosen = [self.tracked[ids[i % len(ids)]].transfer for i in pick] or [self.tracked[ids[-1]].transfer]
        chosen = list(dict.fromkeys(chosen))

        async def go() -> tuple[float, float, TransferError | None, set[int], set[int]]:
            start = self.loop.time()
            err = None
            try:
                await waiting_for_transfer_complete(chosen, timeout=timeout, fail_fast=fail_fast)
            except TransferError as exc:
                err = exc
            end = self.loop.time()
            pending = {t.id for t in chosen if not t.done()}
            failed = {t.id for t in chosen if t.Failed()}
            return start, end, err, pending, failed

        start, end, err, pending, failed = self.run(go())
        assert end - start <= timeout + BOUND
        if err is None:
            assert not pending and not failed
            return
        got_failed = {e.transfer_id for e in err.failed}
        got_timed_out = {e.transfer_id for e in err.timed_out}
        assert got_failed == failed
        if got_timed_out:
            assert end >= start + timeout
            assert got_timed_out == pending
        assert not got_failed & got_timed_out

    @precondition(lambda self: self.open_sessions())
    @rule(which=st.integers(0, 7))
    def abort(self, which: int) -> None:
        rec = self.open_sessions()[which % len(self.open_sessions())]
        self.run(rec.session.abort(timeout=2))
        assert rec.session.channel.idle
        assert all(tr.transfer.done() for tr in rec.transfers)

    @precondition(lambda self: len(self.open_sessions()) > 1)
    @rule(which=st.integers(0, 7))
    def close_session(self, which: int) -> None:
        rec = self.open_sessions()[which % len(self.open_sessions())]
        self.run(rec.session.close())
        assert all(tr.transfer.done() for tr in rec.transfers)

    @precondition(lambda self: len(self.open_sessions()) < 4 and self.remote is not None)
    @rule()
    def new_session(self) -> None:
        local = next(loc for loc in reversed(self.locals) if loc.live)
        assert self.remote is not None
        session = self.run(self.a.create_session(local.desc, self.remote))
        self.sessions.append(SessionRecord(session))

    @rule()
    def deregister_local(self) -> None:
        local = next(loc for loc in reversed(self.locals) if loc.live)
        running = [tr for tr in self.tracked.values() if tr.local is local and not tr.transfer.done()]
        if running:
            with pytest.raises(MemoryInUse):
                self.a.deregister_memory(local.desc)
            return
        self.a.deregister_memory(local.desc)
        local.live = False
        buf = np.zeros(SIZE, dtype=np.uint8)
        self.locals.append(Local(self.a.register_memory(buf, name=f"kv{len(self.locals)}"), buf))

    @precondition(lambda self: self.remote is not None)
    @rule()
    def deregister_remote(self) -> None:
        assert self.remote is not None
        self.b.deregister_memory(self.remote)  # the initiator's later requests on it must fail
        self.remote = None

    @precondition(lambda self: self.remote is None)
    @rule()
    def register_remote(self) -> None:
        self.remote = self.b.register_memory(np.zeros(SIZE, dtype=np.uint8), name="kv")

    @rule()
    def restart_peer(self) -> None:
        async def go() -> IOEngine:
            await self.b.close()
            b = await IOEngine("b", IOEngineConfig(backend="mock", port=self.port, **CONFIG)).start()
            return b

        self.b = self.run(go())
        self.remote = self.b.register_memory(np.zeros(SIZE, dtype=np.uint8), name="kv")

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def nothing_went_wrong_in_callbacks(self) -> None:
        assert not self.violations, self.violations
        assert not self.loop_errors, self.loop_errors

    @invariant()
    def first_terminal_state_is_latched(self) -> None:
        for tr in self.tracked.values():
            t = tr.transfer
            assert tr.ends == (1 if t.done() else 0)
            if tr.first is not None:
                assert (t.Code(), t.Message()) == tr.first

    @invariant()
    def engine_counts_are_exactly_what_still_runs(self) -> None:
        running = [tr for tr in self.tracked.values() if not tr.transfer.done()]
        assert self.a.outstanding == len(running)
        for local in self.locals:
            if local.live:  # a live registration (pins() refuses any other) used by exactly what still runs
                assert self.a.pins(local.desc) == sum(tr.local is local for tr in running)

    def teardown(self) -> None:
        try:
            for rec in self.open_sessions():
                held_qp(rec.session).vanish()
            self.run(self.a.close())
            self.run(self.b.close())
            assert all(tr.ends == 1 for tr in self.tracked.values()), "a transfer never ended or ended twice"
            assert self.a.outstanding == 0
            assert not self.violations, self.violations
            assert not self.loop_errors, self.loop_errors
        finally:
            self.loop.close()


class UvloopTransferMachine(TransferMachine):
    new_loop = staticmethod(uvloop.new_event_loop)


@pytest.mark.parametrize("machine", [TransferMachine, UvloopTransferMachine], ids=["asyncio", "uvloop"])
def test_transfers_faults_aborts_and_restarts_keep_every_invariant(machine: type[TransferMachine]) -> None:
    """Posting reads and writes, NIC faults, deadline waits, aborts, deregistrations and peer restarts,
    in any order: after every step each transfer has ended at most once with its first terminal state
    kept, a session's transfers end in posting order, nothing succeeds on a queue pair after a failure
    there, waits account exactly, and the engine's outstanding and pinned counts are exact."""
    run_state_machine_as_test(machine, settings=settings(stateful_step_count=30))
