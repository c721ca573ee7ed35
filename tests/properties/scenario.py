"""One deadline scenario on the held mock NIC: a batch, NIC steps at chosen times, one wait.

Steps are placed relative to the wait's own deadline T: ``first`` runs
before the wait starts, each ``Timed`` step runs at a fraction of T before
it or after it. With a virtual clock (asyncio) "before" means up to 0.99 T
and "after" from 1.01 T, and T may be a minute; with a real clock (uvloop) T
is tens of milliseconds and steps keep half of T away from the deadline.
The model is fed each step as it runs, so the oracle is exact even if a
loaded machine runs a step late.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from hypothesis import strategies as st

from moriio_async import MemoryInUse, MockOptions, Transfer, TransferError, WcStatus, waiting_for_transfer_complete

from ..engine.conftest import make_pair
from .clock import VirtualClock
from .model import HeldModel, NicStep, held_qp, nic_steps, observed, post_batch, requests_per_transfer

BOUND_VIRTUAL = 0.05
"""Seconds past T a wait may return under a virtual clock (only real time spent computing)."""
BOUND_REAL = 0.5
"""Seconds past T a wait may return under a real clock on a loaded 2-core machine."""


@dataclass(frozen=True, slots=True)
class Timed:
    before_deadline: bool
    at: float
    """Position within its phase, 0..1."""
    step: NicStep

    def offset(self, t: float, virtual: bool) -> float:
        if self.before_deadline:
            return t * self.at * (0.99 if virtual else 0.5)
        lo = 1.01 if virtual else 1.5
        return t * (lo + self.at * (3.0 - lo))


@dataclass(frozen=True, slots=True)
class Scenario:
    wrs: list[int]
    """Requests per transfer."""
    first: list[NicStep]
    timed: list[Timed]
    fail_fast: bool
    silent: bool
    """The CQ raises no channel events: only a drain sees completions."""
    t_virtual: float
    t_real: float
    extra_depth: int = 0
    settle: bool = False
    """Let the reader see the ``first`` steps before the wait begins (transfers already ended)."""
    zero: bool = False
    """Wait with ``timeout=0``: a deadline already passed, not "no deadline"."""
    repeat: tuple[int, ...] = ()
    """Transfers (by index) given to the wait a second time: each must still count once."""


scenarios = st.builds(
    Scenario,
    wrs=requests_per_transfer,
    first=st.lists(nic_steps, max_size=3),
    timed=st.lists(st.builds(Timed, st.booleans(), st.floats(0, 1), nic_steps), max_size=6),
    fail_fast=st.booleans(),
    silent=st.booleans(),
    t_virtual=st.floats(0.5, 60),
    t_real=st.floats(0.02, 0.06),
    extra_depth=st.integers(0, 8),
    settle=st.booleans(),
    zero=st.sampled_from([False, False, False, True]),
    repeat=st.lists(st.integers(0, 5), max_size=4).map(tuple),
)


@dataclass
class Result:
    transfers: list[Transfer]
    timeout: float
    start: float
    end: float
    virtual: bool
    error: TransferError | None
    at_return: dict[int, WcStatus | None]
    """Each transfer's state the moment the wait returned or raised."""
    expected: dict[int, WcStatus | None]
    """The model's state after the steps that had run by then."""
    failed_before: bool
    """Some transfer had already failed when the wait began."""
    last_step: float
    """Loop time of the last NIC step that ran before the wait ended (or its start)."""
    outstanding: int
    """The engine's count of unended transfers the moment the wait returned or raised."""
    refused_deregistration: bool
    """Deregistering the local buffer then raised MemoryInUse (tried only while some transfer ran)."""
    final: dict[int, WcStatus | None] = field(default_factory=dict)
    expected_final: dict[int, WcStatus | None] = field(default_factory=dict)

    @property
    def elapsed(self) -> float:
        return self.end - self.start

    @property
    def deadline_reached(self) -> bool:
        # The comparison the wait itself makes: (start + T) - now <= 0, exact in floating point
        # where end - start >= T may round the other way.
        return self.end >= self.start + self.timeout

    @property
    def bound(self) -> float:
        return BOUND_VIRTUAL if self.virtual else BOUND_REAL


async def run(sc: Scenario) -> Result:
    loop = asyncio.get_running_loop()
    total = sum(sc.wrs)
    a, b, p = await make_pair("mock", mock=MockOptions(hold=True, silent_cq=sc.silent), sq_depth=total + sc.extra_depth)
    try:
        with VirtualClock(loop) as clock:
            timeout = 0.0 if sc.zero else sc.t_virtual if clock.virtual else sc.t_real
            ts = post_batch(p.session, sc.wrs)
            qp = held_qp(p.session)
            model = HeldModel(sc.wrs)

            acted: list[float] = []

            def act(step: NicStep) -> None:
                step.apply(qp)
                model.apply(step)
                acted.append(loop.time())

            for step in sc.first:
                act(step)
            if sc.settle:
                for _ in range(3):
                    await asyncio.sleep(0)
            failed_before = any(t.Failed() for t in ts)
            start = loop.time()
            handles = [loop.call_at(start + t.offset(timeout, clock.virtual), act, t.step) for t in sc.timed]
            error = None
            given = ts + [ts[i % len(ts)] for i in sc.repeat]
            try:
                # The guard turns a wait that ignores its deadline into a failure instead of a hang.
                async with asyncio.timeout(timeout + 5):
                    await waiting_for_transfer_complete(given, timeout=timeout, fail_fast=sc.fail_fast)
            except TransferError as exc:
                error = exc
            end = loop.time()
            at_return = {t.id: observed(t) for t in ts}
            outstanding = a.outstanding
            refused = False
            if not all(t.done() for t in ts):
                try:
                    a.deregister_memory(p.desc_a)
                except MemoryInUse:
                    refused = True
            expected = {t.id: model.outcome(i) for i, t in enumerate(ts)}
            for h in handles:
                h.cancel()
        last_step = max([start, *acted])
        result = Result(
            ts,
            timeout,
            start,
            end,
            clock.virtual,
            error,
            at_return,
            expected,
            failed_before,
            last_step,
            outstanding,
            refused,
        )
        # A timeout is not a cancellation: the rest still runs, and waiting again gives real outcomes.
        act(NicStep("run", total))
        with contextlib.suppress(TransferError):
            # A silent CQ wakes nobody: only the wait's own drain at its deadline sees these.
            await waiting_for_transfer_complete(ts, timeout=0.01 if sc.silent else 10)
        result.final = {t.id: observed(t) for t in ts}
        result.expected_final = {t.id: model.outcome(i) for i, t in enumerate(ts)}
        return result
    finally:
        await a.close()
        await b.close()
