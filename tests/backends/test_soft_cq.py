"""The software completion queue of the TCP and mock backends, on its own: arm, wake, poll, slots, close.

The conformance suite (test_notify.py) drives it through real queue pairs; these pin its own
contract exactly, with a fake slot owner, so a change to any of its rules fails here first.
"""

from __future__ import annotations

import os
import select
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moriio_async.backends.soft.cq import SoftCompletionQueue
from moriio_async.status import Opcode, WcStatus
from moriio_async.work import WorkCompletion


class Owner:
    def __init__(self) -> None:
        self.released: list[int] = []

    def release_slots(self, n: int) -> None:
        self.released.append(n)


def wc(wr_id: int) -> WorkCompletion:
    return WorkCompletion(wr_id, WcStatus.SUCCESS, Opcode.RDMA_WRITE, 64, 5)


def readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


@pytest.fixture
def cq() -> Iterator[SoftCompletionQueue]:
    q = SoftCompletionQueue(16)
    yield q
    q.close()


def test_the_channel_is_a_nonblocking_close_on_exec_eventfd(cq: SoftCompletionQueue) -> None:
    assert cq.depth == 16
    fd = cq.fileno()
    assert fd > 2 and not cq.closed
    assert not os.get_inheritable(fd), "the channel would leak into spawned processes"
    assert os.get_blocking(fd) is False
    assert cq.get_event() is False  # nothing pending: returns at once instead of blocking


def test_unarmed_pushes_are_silent_armed_one_wakes_once(cq: SoftCompletionQueue) -> None:
    owner = Owner()
    cq.push(wc(1), owner, 1)
    assert not readable(cq.fileno())
    cq.req_notify()
    cq.push(wc(2), owner, 1)
    assert readable(cq.fileno())
    assert os.eventfd_read(cq.fileno()) == 1  # one event per arming, as one ibv_get_cq_event
    cq.push(wc(3), owner, 1)  # disarmed by the wakeup
    cq.push_many([(wc(4), 1)], owner)
    assert not readable(cq.fileno())
    assert cq.get_event() is False
    cq.req_notify()
    cq.push_many([(wc(5), 2), (wc(6), 0)], owner)
    assert cq.get_event() is True
    assert cq.get_event() is False
    assert len(cq) == 6
    assert owner.released == []  # slots come back when polled, not when pushed


def test_poll_frees_each_entrys_slots_in_order_and_respects_the_limit(cq: SoftCompletionQueue) -> None:
    a, b = Owner(), Owner()
    cq.push(wc(1), a, 3)
    cq.push_many([(wc(2), 0), (wc(3), 2)], b)
    cq.push(wc(4), a, 1)
    assert [c.wr_id for c in cq.poll(2)] == [1, 2]
    assert a.released == [3] and b.released == [0]
    assert len(cq) == 2
    assert cq.poll(0) == []
    assert [c.wr_id for c in cq.poll(10)] == [3, 4]
    assert a.released == [3, 1] and b.released == [0, 2]
    assert cq.poll() == [] and len(cq) == 0


def test_poll_takes_at_most_64_by_default(cq: SoftCompletionQueue) -> None:
    owner = Owner()
    cq.push_many([(wc(i), 1) for i in range(100)], owner)
    assert [c.wr_id for c in cq.poll()] == list(range(64))
    assert len(owner.released) == 64
    assert [c.wr_id for c in cq.poll()] == list(range(64, 100))


def test_notify_false_never_writes_the_channel() -> None:
    q = SoftCompletionQueue(4, notify=False)
    try:
        q.req_notify()
        q.push(wc(1), Owner(), 1)
        q.push_many([(wc(2), 1)], Owner())
        assert not readable(q.fileno())
        assert q.get_event() is False
        assert [c.wr_id for c in q.poll()] == [1, 2]
    finally:
        q.close()


def test_close_is_idempotent_disarms_and_keeps_queued_completions() -> None:
    q = SoftCompletionQueue(4)
    fd = q.fileno()
    q.req_notify()
    owner = Owner()
    q.push(wc(1), owner, 2)
    q.req_notify()
    q.close()
    assert q.closed and q.fileno() == -1
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(fd)  # the eventfd is closed, not leaked
    q.close()
    assert q.closed
    q.push(wc(2), owner, 1)  # after close: queued, no write to a closed (or reused) fd
    assert [c.wr_id for c in q.poll()] == [1, 2]
    assert owner.released == [2, 1]
    q.req_notify()
    q.push(wc(3), owner, 1)  # armed again after close: still nothing written
    assert len(q) == 1


def test_an_armed_queue_closed_never_writes_a_reused_fd_number() -> None:
    q = SoftCompletionQueue(4)
    q.req_notify()
    q.close()
    r, w = os.pipe()  # likely takes the eventfd's number
    try:
        q.push(wc(1), Owner(), 1)
        assert not readable(r)
    finally:
        os.close(r)
        os.close(w)


@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("push"), st.integers(0, 3)),
            st.tuples(st.just("many"), st.lists(st.integers(0, 3), max_size=4)),
            st.tuples(st.just("poll"), st.integers(0, 5)),
            st.tuples(st.just("arm"), st.just(0)),
            st.tuples(st.just("event"), st.just(0)),
        ),
        max_size=40,
    )
)
def test_matches_a_reference_model(ops: list[tuple[str, object]]) -> None:
    """FIFO order, slots freed exactly at poll, and the arm/wake rule: the first push while armed (and only
    it) raises one event."""
    q = SoftCompletionQueue(8)
    owner = Owner()
    try:
        queue: list[tuple[int, int]] = []
        released: list[int] = []
        armed = pending = False
        next_id = 0
        for op, arg in ops:
            if op == "push" or op == "many":
                slots = [arg] if op == "push" else arg
                assert isinstance(slots, list)
                batch = []
                for s in slots:
                    batch.append((next_id, s))
                    next_id += 1
                if op == "push":
                    q.push(wc(batch[0][0]), owner, batch[0][1])
                else:
                    q.push_many([(wc(i), s) for i, s in batch], owner)
                queue += batch
                if armed:
                    armed, pending = False, True
            elif op == "poll":
                assert isinstance(arg, int)
                got = [c.wr_id for c in q.poll(arg)]
                taken, queue = queue[:arg], queue[arg:]
                assert got == [i for i, _ in taken]
                released += [s for _, s in taken]
            elif op == "arm":
                q.req_notify()
                armed = True
            else:
                assert q.get_event() is pending
                pending = False
            assert owner.released == released
            assert len(q) == len(queue)
            assert readable(q.fileno()) is pending
    finally:
        q.close()


def test_a_channel_on_fd_0_still_wakes() -> None:
    """A daemon started with stdin closed gets fd 0 for its first eventfd: 0 is a valid channel."""
    saved = os.dup(0)
    try:
        os.close(0)
        q = SoftCompletionQueue(4)
        try:
            assert q.fileno() == 0 and not q.closed
            q.req_notify()
            q.push(wc(1), Owner(), 1)
            assert readable(0), "the wakeup of a channel on fd 0 was skipped"
            assert q.get_event() is True
        finally:
            q.close()
        with pytest.raises(OSError, match="Bad file descriptor"):
            os.fstat(0)  # closed, not leaked
    finally:
        os.dup2(saved, 0)
        os.close(saved)
