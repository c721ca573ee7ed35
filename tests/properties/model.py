"""The oracle for the held mock NIC, and the strategies that drive it.

With ``MockOptions(hold=True)`` the mock queue pair keeps every posted request
until the test calls ``step``; ``HeldModel`` computes, from the same calls,
what each transfer's outcome must be. The properties compare the runtime's
answers with it. It assumes every request was posted at once (the send
queue is at least as deep as the batch), so requests are held in posting
order, transfer after transfer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from hypothesis import strategies as st

from moriio_async import MockOptions, Session, Transfer, WcStatus
from moriio_async.backends.mock import MockQueuePair

from ..engine.conftest import Pair, make_pair

ERRORS = [
    WcStatus.REM_ACCESS_ERR,
    WcStatus.REM_OP_ERR,
    WcStatus.LOC_PROT_ERR,
    WcStatus.RETRY_EXC_ERR,
    WcStatus.REM_INV_REQ_ERR,
]
BLOCK = 8
"""Bytes per block; blocks sit 2*BLOCK apart on both sides so each becomes its own request."""


@dataclass(frozen=True, slots=True)
class NicStep:
    """One thing the NIC does: run ``n`` held requests, fail the next one, or lose the peer."""

    kind: str  # "run" | "fail" | "vanish"
    n: int = 1
    status: WcStatus = WcStatus.REM_ACCESS_ERR

    def apply(self, qp: MockQueuePair) -> None:
        if self.kind == "run":
            qp.step(self.n)
        elif self.kind == "fail":
            qp.fail_next(self.status)
            qp.step(1)
        else:
            qp.vanish()


nic_steps = st.one_of(
    st.builds(NicStep, st.just("run"), st.integers(1, 4)),
    st.builds(NicStep, st.just("fail"), st.just(1), st.sampled_from(ERRORS)),
    st.builds(NicStep, st.just("vanish")),
)
requests_per_transfer = st.lists(st.integers(1, 3), min_size=1, max_size=6)


class HeldModel:
    """Per-request outcomes of one held queue pair, from the steps applied to it."""

    def __init__(self, wrs_per_transfer: Sequence[int]) -> None:
        self.owner = [t for t, k in enumerate(wrs_per_transfer) for _ in range(k)]
        self.n_transfers = len(wrs_per_transfer)
        self.status: list[WcStatus | None] = [None] * len(self.owner)
        self.next = 0
        self.error = False
        self.armed: WcStatus | None = None

    def apply(self, step: NicStep) -> None:
        if step.kind == "run":
            self._run(step.n)
        elif step.kind == "fail":
            self.armed = step.status
            self._run(1)
        else:
            if self.next < len(self.owner) and not self.error:
                self.armed = WcStatus.RETRY_EXC_ERR
                self._run(len(self.owner))
            self.error = True

    def _run(self, n: int) -> None:
        for _ in range(n):
            if self.next >= len(self.owner):
                return
            if self.error:
                status = WcStatus.WR_FLUSH_ERR
            elif self.armed is not None:
                status, self.armed, self.error = self.armed, None, True
            else:
                status = WcStatus.SUCCESS
            self.status[self.next] = status
            self.next += 1

    def outcome(self, t: int) -> WcStatus | None:
        """None while some request of transfer ``t`` has not run; else its folded status."""
        mine = [s for i, s in enumerate(self.status) if self.owner[i] == t]
        if any(s is None for s in mine):
            return None
        failures = [s for s in mine if s is not None and s is not WcStatus.SUCCESS]
        if not failures:
            return WcStatus.SUCCESS
        root = [s for s in failures if s is not WcStatus.WR_FLUSH_ERR]
        return root[0] if root else WcStatus.WR_FLUSH_ERR


def post_batch(session: Session, wrs_per_transfer: Sequence[int]) -> list[Transfer]:
    """One transfer per entry, each of that many requests (blocks not contiguous remotely)."""
    out = []
    base = 0
    for i, k in enumerate(wrs_per_transfer):
        offs = [(base + j) * 2 * BLOCK for j in range(k)]
        base += k
        out.append(
            session.batch_read(offs, offs, [BLOCK] * k) if i % 2 else session.batch_write(offs, offs, [BLOCK] * k)
        )
    return out


def held_qp(session: Session) -> MockQueuePair:
    qp = session.channel.qp
    assert isinstance(qp, MockQueuePair), "this property drives the mock backend's held queue pair"
    return qp


def observed(t: Transfer) -> WcStatus | None:
    """The runtime's answer in the model's terms."""
    if not t.done():
        return None
    if t.Succeeded():
        return WcStatus.SUCCESS
    err = t.error()
    assert err is not None and err.wc_status is not None
    return err.wc_status


@contextlib.asynccontextmanager
async def held_pair(silent: bool = False, **config: object) -> AsyncIterator[Pair]:
    """Two mock engines whose NIC runs a request only when the test steps it."""
    config.setdefault("abort_timeout", 1.0)  # a runtime broken on purpose should fail fast, not hang in abort
    a, b, p = await make_pair("mock", mock=MockOptions(hold=True, silent_cq=silent), **config)
    try:
        yield p
    finally:
        await a.close()
        await b.close()


@contextlib.asynccontextmanager
async def engine_pair(backend: str, **config: object) -> AsyncIterator[Pair]:
    a, b, p = await make_pair(backend, **config)
    try:
        yield p
    finally:
        await a.close()
        await b.close()


async def settle(rounds: int = 3) -> None:
    """Let the completion reader run (each round is one loop iteration)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


async def run_until_done(p: Pair, ts: Sequence[Transfer], limit: float = 10.0) -> None:
    """Step whatever queue pair ``p.session`` has now (it may reconnect meanwhile) until ``ts`` end."""
    session = p.session
    loop = asyncio.get_running_loop()
    give_up = loop.time() + limit
    while not all(t.done() for t in ts):
        assert loop.time() < give_up, f"transfers still running after {limit}s: {list(ts)}"
        held_qp(session).step(1 << 20)
        p.a.drain_completions()  # a silent completion queue raises no event
        await asyncio.sleep(0.001)
