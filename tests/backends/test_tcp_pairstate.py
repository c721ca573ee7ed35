"""A TCP queue pair's locked state on its own, driven as its threads drive it: the poster admits
batches, the sender takes chunks (one opcode, at most MAX_CHUNK requests and about CHUNK_BYTES of
payload, in posting order) and settles them, the receiver completes the head; entering ERR fails the
oldest outstanding request and flushes the rest, each completion with the slots it frees.

No sockets and no threads: each step is called directly under the pair's lock."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from moriio_async.backends.base import QpState
from moriio_async.backends.soft.cq import SoftCompletionQueue
from moriio_async.backends.tcp import Hooks, VendorErr
from moriio_async.backends.tcp.pairstate import CHUNK_BYTES, Chunk, PairState, Span
from moriio_async.backends.tcp.regions import RegionTable
from moriio_async.backends.tcp.wire import MAX_CHUNK, SEQ_MASK
from moriio_async.status import Opcode, WcStatus
from moriio_async.work import Sge, WorkBatch, WorkRequest

W, R = Opcode.RDMA_WRITE, Opcode.RDMA_READ
QP = 5


def batch(ops: list[Opcode], lengths: list[int] | None = None, signaled: list[bool] | None = None,
          first: int = 0) -> WorkBatch:  # fmt: skip
    lengths = lengths or [64] * len(ops)
    signaled = signaled or [True] * len(ops)
    return WorkBatch.from_requests(
        [WorkRequest(first + i, op, (Sge(0x1000, n, 3),), 0x2000, 9, s)
         for i, (op, n, s) in enumerate(zip(ops, lengths, signaled, strict=True))]
    )  # fmt: skip


def pair(hooks: Hooks | None = None) -> PairState:
    st = PairState(QP, SoftCompletionQueue(1 << 12), RegionTable(), hooks)
    st.state = QpState.RTS
    return st


def polled(st: PairState) -> list[tuple[int, WcStatus, int]]:
    return [(wc.wr_id, wc.status, wc.vendor_err) for wc in st.cq.poll(1 << 12)]


def spans(ch: list[Chunk]) -> list[tuple[int, int]]:
    return [(c.lo, c.hi) for c in ch]


def test_a_span_is_cut_where_the_opcode_changes_at_max_chunk_and_after_chunk_bytes() -> None:
    b = batch([W, W, R, R, R, W])
    s = Span(b, 0)
    ends = []
    while s.pos < len(b):
        s.pos = s.next_chunk(False)
        ends.append(s.pos)
    assert ends == [2, 5, 6]
    assert Span(b, 0).next_chunk(True) == 1  # a hooked pair: one request a chunk
    big = batch([W] * (MAX_CHUNK + 5))
    s = Span(big, 0)
    assert s.next_chunk(False) == MAX_CHUNK
    s.pos = MAX_CHUNK
    assert s.next_chunk(False) == MAX_CHUNK + 5
    half = CHUNK_BYTES // 2
    b = batch([W] * 5, [half, half, 1, half - 1, CHUNK_BYTES + 1])
    s, ends = Span(b, 0), []
    while s.pos < len(b):
        s.pos = s.next_chunk(False)
        ends.append(s.pos)
    assert ends == [2, 4, 5]  # up to CHUNK_BYTES each, and a larger request alone
    s = Span(batch([R, R], [CHUNK_BYTES + 1, 8]), 0)
    assert s.next_chunk(False) == 1


def test_the_sender_takes_chunks_in_posting_order_up_to_its_byte_budget() -> None:
    st = pair()
    with st.lock:
        st.admit_locked(batch([W, W, R], [100, 100, 100]))
        st.admit_locked(batch([W, W], [300, 300], first=3))
        assert st.posted == 5
        first = st.take_locked(150)  # the WRITEs of the first batch are 200 bytes: over budget after them
        assert spans(first) == [(0, 2)] and [c.seq for c in first] == [0]
        rest = st.take_locked(1 << 20)  # a READ carries no payload: the next batch joins
        assert spans(rest) == [(2, 3), (0, 2)] and [c.seq for c in rest] == [2, 3]
        assert [c.is_read for c in rest] == [True, False] and rest[1].wire_seq(1) == 4
        assert not st.pending and list(st.wire) == first + rest
        assert st.take_locked(1 << 20) == []
        st.admit_locked(batch([W], first=5))
        st.send_stopped = True
        assert st.take_locked(1 << 20) == []  # after a local failure nothing more is sent
        st.send_stopped = False
        st.state = QpState.ERR
        assert st.take_locked(1 << 20) == []


def test_the_byte_budget_is_summed_over_chunks_and_reached_exactly() -> None:
    st = pair()
    with st.lock:
        for i in range(3):
            st.admit_locked(batch([W], [100], first=i))
        assert spans(st.take_locked(150)) == [(0, 1), (0, 1)] and len(st.pending) == 1  # 100, then 200
        assert spans(st.take_locked(1)) == [(0, 1)]  # a budget of one byte still takes a chunk
    st = pair()
    with st.lock:
        st.admit_locked(batch([W, W, R], [100, 100, 100]))
        assert spans(st.take_locked(200)) == [(0, 2)]  # exactly the budget: no more


def test_a_hooked_pair_takes_one_request_a_chunk() -> None:
    st = pair(Hooks())
    with st.lock:
        st.admit_locked(batch([W, W, W]))
        assert spans(st.take_locked(100)) == [(0, 1), (1, 2)]  # 64 bytes each: the budget ends after two


def test_responses_complete_the_head_in_order_with_the_slots_each_frees() -> None:
    st = pair()
    with st.lock:
        st.admit_locked(batch([W, W, W, R, R], signaled=[False, True, False, False, True]))
        chunks = st.take_locked(1 << 20)
        assert spans(chunks) == [(0, 3), (3, 5)]
        assert st.settle_locked(chunks, {}) and all(c.sent for c in chunks)
        st.complete_locked(chunks[0], 2)
        assert chunks[0].next == 2 and st.wire[0] is chunks[0]
    assert polled(st) == [(1, WcStatus.SUCCESS, 0)] and st.released == 2
    with st.lock:
        st.complete_locked(chunks[0], 1)  # the unsignaled third is left for the next completion
        assert st.wire[0] is chunks[1] and st.uncovered == 1
        st.complete_locked(chunks[1], 2)
        assert not st.wire
    assert polled(st) == [(4, WcStatus.SUCCESS, 0)] and st.released == 5


def test_a_preset_failure_stops_sending_and_fails_in_order() -> None:
    st = pair()
    with st.lock:
        st.admit_locked(batch([W, W, W, W], signaled=[True, False, True, True]))
        chunks = st.take_locked(1 << 20)
        # Request 2 fails at the sender (a local protection error): 0 and 1 still go out.
        assert st.settle_locked(chunks, {0: (2, WcStatus.LOC_PROT_ERR, VendorErr.LOCAL_OUT_OF_BOUNDS)})
        assert st.send_stopped and spans(list(st.wire)) == [(0, 2), (2, 4)]
        assert st.wire[0].sent and not st.wire[1].sent and st.wire[1].seq == 2
        assert polled(st) == []  # the failure waits for the requests before it
        st.complete_locked(st.wire[0], 2)
        st.complete_presets_locked()
        assert st.state == QpState.ERR and not st.wire
    assert polled(st) == [
        (0, WcStatus.SUCCESS, 0),
        (2, WcStatus.LOC_PROT_ERR, VendorErr.LOCAL_OUT_OF_BOUNDS),
        (3, WcStatus.WR_FLUSH_ERR, 0),
    ]
    assert st.released == 4  # the failure frees its slot and the success before it


def test_a_preset_success_completes_without_the_wire() -> None:
    st = pair()
    with st.lock:
        st.admit_locked(batch([W, W]))
        chunks = st.take_locked(1 << 20)
        assert st.settle_locked(chunks, {0: (0, WcStatus.SUCCESS, 0)})
        assert not st.wire and not st.send_stopped and st.state == QpState.RTS
    assert polled(st) == [(0, WcStatus.SUCCESS, 0), (1, WcStatus.SUCCESS, 0)]
    st.state = QpState.ERR
    with st.lock:
        assert not st.settle_locked([Chunk(batch([W]), 0, 1, 2)], {})


def test_entering_err_fails_the_oldest_outstanding_request_and_flushes_the_rest() -> None:
    class Responder:
        stops = 0

        def stop(self) -> None:
            Responder.stops += 1

        def join(self) -> None:
            pass

    st = pair()
    assert st.attach(Responder()) and not st.attach(Responder())
    with st.lock:
        st.admit_locked(batch([W, W], signaled=[False, True]))
        chunks = st.take_locked(1 << 20)
        st.settle_locked(chunks, {})
        st.complete_locked(chunks[0], 1)  # one unsignaled success, uncovered
        st.admit_locked(batch([R, R], first=2))
    st.fail(WcStatus.REM_ACCESS_ERR, VendorErr.REMOTE_NO_ACCESS)
    st.peer_lost(VendorErr.PEER_RESET)  # already in ERR: nothing more
    st.fail(WcStatus.GENERAL_ERR, 0)
    assert st.state == QpState.ERR and Responder.stops == 1
    assert not st.wire and not st.pending
    assert polled(st) == [
        (1, WcStatus.REM_ACCESS_ERR, VendorErr.REMOTE_NO_ACCESS),
        (2, WcStatus.WR_FLUSH_ERR, 0),
        (3, WcStatus.WR_FLUSH_ERR, 0),
    ]
    assert st.released == 4
    with st.lock:
        st.admit_locked(batch([W, R], first=4))  # posted in ERR: flushed at once
        assert st.posted == 6 and not st.pending
    assert polled(st) == [(4, WcStatus.WR_FLUSH_ERR, 0), (5, WcStatus.WR_FLUSH_ERR, 0)]
    assert st.released == 6


def test_a_lost_peer_fails_the_oldest_pending_request() -> None:
    st = pair()
    with st.lock:
        st.admit_locked(batch([R, W]))
    st.peer_lost(VendorErr.PEER_CLOSED)
    assert polled(st) == [(0, WcStatus.RETRY_EXC_ERR, VendorErr.PEER_CLOSED), (1, WcStatus.WR_FLUSH_ERR, 0)]
    two = pair()
    with two.lock:
        two.admit_locked(batch([W]))
        two.admit_locked(batch([R], first=1))
        two.admit_locked(batch([W], first=2))
    two.peer_lost(VendorErr.PEER_RESET)  # only the oldest carries the reason, in every later batch too
    assert polled(two) == [
        (0, WcStatus.RETRY_EXC_ERR, VendorErr.PEER_RESET),
        (1, WcStatus.WR_FLUSH_ERR, 0),
        (2, WcStatus.WR_FLUSH_ERR, 0),
    ]
    idle = pair()
    idle.fail(WcStatus.GENERAL_ERR, 0)  # nothing outstanding: no completion
    assert idle.state == QpState.ERR and polled(idle) == []


def test_only_a_pair_in_rts_without_a_responder_accepts_a_dial() -> None:
    class Responder:
        def stop(self) -> None:
            pass

        def join(self) -> None:
            pass

    st = PairState(QP, SoftCompletionQueue(8), RegionTable(), None)
    assert not st.attach(Responder())  # still INIT
    st.state = QpState.RTS
    st.closed = True
    assert not st.attach(Responder())
    st.closed = False
    assert st.attach(Responder())
    st.responder_done()
    assert st.state == QpState.ERR


@pytest.mark.parametrize("seq", [0, SEQ_MASK - 1])
def test_wire_sequence_numbers_wrap_at_32_bits(seq: int) -> None:
    c = Chunk(batch([W, W, W, W]), 1, 4, seq)
    assert [c.wire_seq(i) for i in range(1, 4)] == [(seq + j) & SEQ_MASK for j in range(3)]
    assert c.opcode == int(W) and not c.is_read and c.next == 1 and not c.sent


def test_chunk_bytes_count_writes_only() -> None:
    st = pair()
    with st.lock:
        st.admit_locked(batch([R] * 3 + [W] * 3, [CHUNK_BYTES] * 3 + [10, 10, 10]))
        st.admit_locked(batch([W], first=6))
        # READs carry no payload: the budget of 15 bytes is spent by the first WRITE chunk (30 bytes).
        assert spans(st.take_locked(15)) == [(0, 1), (1, 2), (2, 3), (3, 6)]
        assert len(st.pending) == 1 and st.pending[0].pos == 0


def test_a_later_chunk_of_a_span_counts_only_its_own_bytes() -> None:
    st = pair()
    with st.lock:
        st.admit_locked(batch([W, W, R, W, W], [100] * 5))
        st.admit_locked(batch([W], [100], first=5))
        st.admit_locked(batch([W], [100], first=6))
        # 200, 0, then 200 for requests 3 and 4 (not 500, nor 0): 400 < 401, so one more, 500.
        assert spans(st.take_locked(401)) == [(0, 2), (2, 3), (3, 5), (0, 1)] and len(st.pending) == 1


def test_a_preset_inside_a_chunk_splits_it_in_place() -> None:
    st = pair()
    with st.lock:
        st.admit_locked(batch([W, W, R, R]))
        chunks = st.take_locked(1 << 20)
        assert spans(chunks) == [(0, 2), (2, 4)]
        assert st.settle_locked(chunks, {0: (1, WcStatus.LOC_PROT_ERR, VendorErr.UNKNOWN_LKEY)})
        assert spans(list(st.wire)) == [(0, 1), (1, 2), (2, 4)]
        assert [c.sent for c in st.wire] == [True, False, False]  # nothing after the failure is sent
        st.complete_locked(st.wire[0], 1)
        st.complete_presets_locked()
    assert polled(st) == [
        (0, WcStatus.SUCCESS, 0),
        (1, WcStatus.LOC_PROT_ERR, VendorErr.UNKNOWN_LKEY),
        (2, WcStatus.WR_FLUSH_ERR, 0),
        (3, WcStatus.WR_FLUSH_ERR, 0),
    ]


def test_a_preset_in_a_later_chunk_keeps_posting_numbers() -> None:
    st = pair()
    with st.lock:
        st.admit_locked(batch([W, W, R, R, R]))
        chunks = st.take_locked(1 << 20)
        assert spans(chunks) == [(0, 2), (2, 5)]
        assert st.settle_locked(chunks, {1: (3, WcStatus.LOC_PROT_ERR, VendorErr.LOCAL_NO_ACCESS)})
        assert [(c.lo, c.hi, c.seq) for c in st.wire] == [(0, 2, 0), (2, 3, 2), (3, 5, 3)]
        assert st.wire[2].wire_seq(4) == 4


def test_a_preset_success_behind_the_head_completes_once_the_head_does() -> None:
    st = pair()
    with st.lock:
        st.admit_locked(batch([W, W, R, R], signaled=[True, False, False, True]))
        chunks = st.take_locked(1 << 20)
        assert st.settle_locked(chunks, {1: (2, WcStatus.SUCCESS, 0)})
        assert polled(st) == []  # the head is on the wire
        st.complete_locked(st.wire[0], 2)
        st.complete_presets_locked()
        assert not st.wire and st.uncovered == 0
    assert polled(st) == [(0, WcStatus.SUCCESS, 0), (3, WcStatus.SUCCESS, 0)] and st.released == 4


def test_settling_the_head_wakes_the_receiver() -> None:
    st = pair()
    woke: list[float] = []

    def receiver() -> None:
        with st.lock:
            started = time.monotonic()
            while not (st.wire and st.wire[0].sent):
                if not st.recv_cv.wait(10):
                    break
            woke.append(time.monotonic() - started)

    with st.lock:
        st.admit_locked(batch([W]))
        chunks = st.take_locked(1 << 20)
    t = threading.Thread(target=receiver)
    t.start()
    time.sleep(0.2)  # the receiver waits for the head to be sent
    with st.lock:
        st.settle_locked(chunks, {})
    t.join(15)
    assert woke and woke[0] < 5, "the receiver was not woken"


def test_entering_err_with_a_socket_that_cannot_shut_down_still_flushes() -> None:
    st = pair()
    st.sock = socket.socket()  # never connected: shutdown fails (ENOTCONN), which is ignored
    try:
        with st.lock:
            st.admit_locked(batch([W, R]))
            chunks = st.take_locked(1 << 20)
            st.settle_locked(chunks, {})
            assert spans(list(st.wire)) == [(0, 1), (1, 2)]  # two chunks on the wire
        st.fail(WcStatus.BAD_RESP_ERR, VendorErr.BAD_RESPONSE)
    finally:
        st.sock.close()
    wcs = st.cq.poll(8)
    assert [(wc.wr_id, wc.status, wc.vendor_err, wc.byte_len, wc.qp_num) for wc in wcs] == [
        (0, WcStatus.BAD_RESP_ERR, VendorErr.BAD_RESPONSE, 0, QP),
        (1, WcStatus.WR_FLUSH_ERR, 0, 0, QP),
    ]
