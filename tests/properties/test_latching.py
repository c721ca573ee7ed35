"""Latching: a transfer's first terminal state is final."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moriio_async import StatusCode, Transfer, TransferFailed, WcStatus
from moriio_async.status import Opcode
from moriio_async.work import WorkCompletion

from .conftest import needs_held_mock
from .model import ERRORS, NicStep, held_pair, held_qp, nic_steps, post_batch, requests_per_transfer, settle

pytestmark = needs_held_mock


@dataclass(frozen=True, slots=True)
class Late:
    """Something reaching transfer ``target`` (by index) or the channel after the fact."""

    kind: str  # "account" | "fail" | "wc" | "abort"
    target: int
    status: WcStatus
    wr_id: int


events = st.one_of(
    nic_steps,
    st.builds(
        Late,
        st.sampled_from(["account", "fail", "wc", "abort"]),
        st.integers(0, 5),
        st.sampled_from([WcStatus.SUCCESS, WcStatus.WR_FLUSH_ERR, *ERRORS]),
        st.integers(0, 20),
    ),
)


def snapshot(t: Transfer) -> tuple[int, str, TransferFailed | None]:
    return t.Code(), t.Message(), t.error()


@given(requests_per_transfer, st.lists(events, max_size=12))
async def test_first_terminal_state_is_latched(wrs: list[int], script: list[NicStep | Late]) -> None:
    """Once a transfer has Succeeded() or Failed(), its Code(), Message(), error() and what awaiting it
    gives never change, whatever comes after: more NIC steps, late or duplicate completions, failures
    reported for it again, flushes, or an abort of its session."""
    async with held_pair() as p:
        ts = post_batch(p.session, wrs)
        first: dict[int, tuple[int, str, TransferFailed | None]] = {}

        def check() -> None:
            for t in ts:
                if t.id in first:
                    assert snapshot(t) == first[t.id], f"transfer {t.id} changed after it ended"
                elif t.done():
                    assert t.Succeeded() or t.Failed()
                    first[t.id] = snapshot(t)

        for event in script:
            if isinstance(event, NicStep):
                event.apply(held_qp(p.session))
            elif event.kind == "abort":
                await p.session.abort()
            elif event.kind == "wc":
                # A completion the runtime did not ask for: a duplicate, or one for a request long gone.
                p.session.channel.on_completion(
                    WorkCompletion(event.wr_id, event.status, Opcode.RDMA_READ, 0, p.session.channel.qp_num)
                )
            else:
                t = ts[event.target % len(ts)]
                if t.id not in first:
                    continue  # only what reaches a transfer after it ended is this property's business
                if event.kind == "account":
                    t.settle(1, event.status)
                else:
                    t.fail(StatusCode.ERR_BAD_STATE, "reported again later")
            await settle()
            check()
        await p.session.abort()
        check()
        for t in ts:
            assert t.id in first
            if t.Succeeded():
                await asyncio.wait_for(t.wait(), 1)
            else:
                with pytest.raises(TransferFailed) as info:
                    await t
                assert info.value is first[t.id][2]
