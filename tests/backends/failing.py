"""Failing a pair in the middle of a WRITE stream, for tests/backends and tests/properties: the
failures, the stream, and the checks on what it left (issue 23, item 1)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

from moriio_async.backends.base import MemoryRegion, SendQueueFull
from moriio_async.backends.tcp import TcpRegion
from moriio_async.status import WcStatus
from moriio_async.work import WorkCompletion

from .harness import WAIT, Pair

__all__ = [
    "BLOCK",
    "FAILURES",
    "assert_ended_once_in_rc_order",
    "deregisters",
    "own_pins",
    "returns",
    "stream_and_fail",
]

BLOCK = 64 << 10  # what a post may send itself on tcp (the doorbell): the socket takes part of it
FAILURES = ["target deregisters", "bad rkey", "target pair closed", "local to_error"]


def own_pins(mr: MemoryRegion) -> int:
    """Pins a software NIC holds on a local region (tcp counts them; others hold none to count)."""
    return mr.pins if isinstance(mr, TcpRegion) else 0


def returns(call: Callable[[], None]) -> bool:
    """Run ``call`` on a thread; False if it is still running after WAIT seconds (it hangs)."""
    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(WAIT)
    return not t.is_alive()


def deregisters(side_deregister: Callable[[MemoryRegion], None], mr: MemoryRegion) -> bool:
    """Deregister ``mr`` on a thread; False if it has not returned within WAIT seconds (it hangs)."""
    t = threading.Thread(target=side_deregister, args=(mr,), daemon=True)
    t.start()
    t.join(WAIT)
    return not t.is_alive()


def assert_ended_once_in_rc_order(wcs: list[WorkCompletion], posted: int) -> None:
    """Each request completed exactly once; successes, then at most one error, then flushes only."""
    counts = Counter(wc.wr_id for wc in wcs)
    assert sorted(counts) == list(range(posted)) and set(counts.values()) == {1}, counts
    by_id = [wc.status for wc in sorted(wcs, key=lambda wc: wc.wr_id)]
    first_bad = next((i for i, s in enumerate(by_id) if s is not WcStatus.SUCCESS), posted)
    assert all(s is WcStatus.WR_FLUSH_ERR for s in by_id[first_bad + 1 :]), Counter(by_id)


def stream_and_fail(pair: Pair, failure: str, fail_at: int, total: int, block: int = BLOCK) -> list[WorkCompletion]:
    """Post ``total`` single WRITEs of ``block`` bytes one by one (at BLOCK, the doorbell's case),
    failing the pair as ``failure`` says before post ``fail_at``; every completion."""
    got: list[WorkCompletion] = []
    for i in range(total):
        if i == fail_at:
            if failure == "target deregisters":
                pair.b.deregister(pair.b.mr)
            elif failure == "target pair closed":
                pair.b.qp.close()
            elif failure == "local to_error":
                pair.a.qp.to_error()
        off = (i * block) % len(pair.b.buf)
        bad = {"rkey": pair.b.mr.rkey ^ 0x5A5A} if failure == "bad rkey" and i == fail_at else {}
        wr = pair.write(i, off, block, off, **bad)
        while True:
            try:
                pair.a.qp.post_send([wr])
                break
            except SendQueueFull:
                got += pair.waiter.wait_some()
    got += pair.waiter.wait(total - len(got))
    return got
