"""The TCP backend's own machinery: its fault-injection seams, its handshake, what it describes."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import numpy as np
import pytest

from moriio_async.backends import open_backend
from moriio_async.backends.base import QpState
from moriio_async.backends.described import TcpFacts
from moriio_async.backends.tcp import Fault, Hooks, TcpOptions, TcpQueuePair, VendorErr, iov
from moriio_async.backends.tcp.wire import MAX_CHUNK, peer_progress
from moriio_async.core.faultplan import Action, FaultPlan, FaultRule
from moriio_async.errors import InvalidArgument, MoriioError
from moriio_async.status import Access, Opcode, WcStatus
from moriio_async.work import WorkRequest

from .harness import WAIT, PairFactory, digest, make_options, statuses, wr_ids

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.only_backends("tcp", reason="tests the TCP backend's hooks, handshake and describe()"),
]


def test_on_send_hook_completes_a_request_with_a_chosen_status(pairs: PairFactory) -> None:
    class FailThird(Hooks):
        def on_send(self, qp_num: int, wr: WorkRequest) -> WcStatus | None:
            return WcStatus.REM_OP_ERR if wr.wr_id == 2 else None

    pair = pairs()
    pair.a.qp.hooks = FailThird()  # type: ignore[attr-defined]
    target = digest(pair.b.buf[2 * 4096 :])
    wcs = pair.run([pair.write(i, i * 4096, 4096, i * 4096, signaled=i != 1) for i in range(5)], expect=4)
    assert wr_ids(wcs) == [0, 2, 3, 4]
    assert statuses(wcs) == [WcStatus.SUCCESS, WcStatus.REM_OP_ERR, WcStatus.WR_FLUSH_ERR, WcStatus.WR_FLUSH_ERR]
    assert digest(pair.b.buf[2 * 4096 :]) == target


def test_on_send_hook_success_skips_the_wire(pairs: PairFactory) -> None:
    class Pretend(Hooks):
        def on_send(self, qp_num: int, wr: WorkRequest) -> WcStatus | None:
            return WcStatus.SUCCESS if wr.wr_id == 1 else None

    pair = pairs()
    pair.a.qp.hooks = Pretend()  # type: ignore[attr-defined]
    pair.a.buf[:] = 3
    wcs = pair.run([pair.write(0, 0, 4096, 0), pair.write(1, 4096, 4096, 4096), pair.write(2, 8192, 4096, 8192)])
    assert wr_ids(wcs) == [0, 1, 2] and set(statuses(wcs)) == {WcStatus.SUCCESS}
    assert (pair.b.buf[:4096] == 3).all() and not (pair.b.buf[4096:8192] == 3).all()


def test_on_response_hook_drop_is_a_dead_peer(pairs: PairFactory) -> None:
    class DropOnSecond(Hooks):
        def on_response(self, qp_num: int, wr: WorkRequest, status: WcStatus) -> Fault | None:
            return Fault.DROP if wr.wr_id == 1 else None

    pair = pairs()
    pair.a.qp.hooks = DropOnSecond()  # type: ignore[attr-defined]
    wcs = pair.run([pair.write(i, 0, 4096, 0) for i in range(4)], expect=4)
    assert statuses(wcs) == [WcStatus.SUCCESS, WcStatus.RETRY_EXC_ERR, WcStatus.WR_FLUSH_ERR, WcStatus.WR_FLUSH_ERR]
    assert pair.a.qp.state == QpState.ERR


def test_target_check_is_named_in_vendor_err(pairs: PairFactory) -> None:
    pair = pairs()
    [wc] = pair.run([pair.write(0, 0, 4096, pair.b.mr.length - 1)])
    assert wc.status is WcStatus.REM_ACCESS_ERR and wc.vendor_err == VendorErr.REMOTE_OUT_OF_BOUNDS


@pytest.mark.parametrize("opcode", [Opcode.RDMA_WRITE, Opcode.RDMA_READ])
def test_a_batch_cut_into_a_full_chunk_and_a_rest_lands_whole(pairs: PairFactory, opcode: Opcode) -> None:
    """The sender cuts a batch of small requests at MAX_CHUNK requests: the target serves a chunk of
    exactly that many (the largest the wire allows), then the rest."""
    n, size = MAX_CHUNK + 5, 16
    pair = pairs(sq_depth=2 * MAX_CHUNK)
    pair.a.buf[: n * size] = np.arange(n * size, dtype=np.uint64).astype(np.uint8)
    expected = (pair.a if opcode is Opcode.RDMA_WRITE else pair.b).buf[: n * size].copy()
    wrs = [pair.wr(i, opcode, [(i * size, size)], i * size, signaled=i == n - 1) for i in range(n)]
    [wc] = pair.run(wrs)
    assert (wc.wr_id, wc.status) == (n - 1, WcStatus.SUCCESS)
    assert np.array_equal(pair.a.buf[: n * size], expected) and np.array_equal(pair.b.buf[: n * size], expected)


def test_describe_names_the_data_port(backend_name: str) -> None:
    backend = open_backend(backend_name, make_options(sq_depth=99))
    try:
        info = backend.describe()
        assert isinstance(info, TcpFacts) and info.backend == "tcp" and info.sq_depth == 99
        assert info.host == "127.0.0.1" and info.data_port > 0
    finally:
        backend.close()


def test_dial_with_a_token_nobody_expects_fails(backend_name: str) -> None:
    opts = make_options(connect_timeout=5.0)
    a, b = open_backend(backend_name, opts), open_backend(backend_name, opts)
    try:
        qa, qb = a.create_qp(a.create_cq(4)), b.create_qp(b.create_cq(4))
        qb.connect(qa.endpoint())
        endpoint = qb.endpoint()
        qb.close()  # the passive pair is gone before the active one dials
        with pytest.raises(MoriioError, match="refused"):
            qa.connect(endpoint)
        assert qa.state == QpState.INIT
    finally:
        a.close()
        b.close()


def test_passive_pair_refuses_posts(pairs: PairFactory) -> None:
    pair = pairs()
    with pytest.raises(InvalidArgument, match="passive"):
        pair.b.qp.post_send([WorkRequest(1, Opcode.RDMA_WRITE, (), pair.a.mr.addr, pair.a.mr.rkey)])


def test_a_slow_target_is_not_a_dead_one(pairs: PairFactory) -> None:
    """Each response comes well within retry_timeout, the whole batch takes longer: no RETRY_EXC_ERR."""

    class Slow(Hooks):
        def on_request(self, qp_num: int, opcode: int, rkey: int, remote_addr: int, length: int) -> None:
            time.sleep(0.15)

    pair = pairs(retry_timeout=0.5)
    pair.b.qp.hooks = Slow()  # type: ignore[attr-defined]
    wcs = pair.run([pair.write(i, 0, 4096, 0) for i in range(8)])  # ~1.2 s in all
    assert set(statuses(wcs)) == {WcStatus.SUCCESS}


def test_peer_progress_sees_acknowledged_bytes() -> None:
    """The receive-timeout check: queued bytes buy one more timeout; then only acknowledged bytes count."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
        with client, peer:
            assert peer_progress(client, None)[1] is False  # nothing queued: silence is silence
            client.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                while True:
                    client.send(bytes(1 << 16))
            mark, progressing = peer_progress(client, None)
            assert progressing and mark is not None
            # The peer's kernel may still be acknowledging what was in flight when the send buffer filled
            # (slowly, in an emulated guest): once its receive window is full the acks stop, and from then
            # on a peer that reads nothing shows no progress.
            deadline = time.monotonic() + WAIT
            while (now := peer_progress(client, mark))[1]:
                assert time.monotonic() < deadline, "the peer kept acknowledging bytes it never read"
                mark = now[0]
                time.sleep(0.05)
            assert peer_progress(client, mark) == (mark, False)  # the peer reads nothing
            peer.recv(1 << 20)
            deadline = time.monotonic() + WAIT
            while not peer_progress(client, mark)[1]:
                assert time.monotonic() < deadline
                time.sleep(0.01)


def test_doorbell_writes_the_socket_would_not_take_finish_on_the_sender(
    pairs: PairFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """post writes small requests itself (MSG_DONTWAIT); a partial write is finished by the sender thread."""
    from moriio_async.backends.tcp import qp, sender
    from moriio_async.backends.tcp.pairstate import PairState

    partial = []

    def counting(st: PairState, sock: socket.socket, rnd: sender.Round) -> None:
        sender.ring(st, sock, rnd)
        partial.append(st.tx_pending is not None)

    monkeypatch.setattr(qp, "ring", counting)
    pair = pairs(8 << 20, 8 << 20, sq_depth=64)
    active = pair.a.qp
    assert isinstance(active, TcpQueuePair)
    sock = active.pair_state.sock
    assert sock is not None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    pair.a.buf[:] = np.random.default_rng(3).integers(0, 256, len(pair.a.buf), dtype=np.uint8)
    chunk, n, done = 40 << 10, 200, 0
    posted = 0
    while done < n:
        while posted < n and posted - done < active.max_send_wr:
            off = posted * chunk
            active.post_send([pair.write(posted, off, chunk, off)])  # one at a time: the doorbell path
            posted += 1
        wcs = pair.waiter.wait_some()
        assert [wc.wr_id for wc in wcs] == list(range(done, done + len(wcs)))
        assert {wc.status for wc in wcs} == {WcStatus.SUCCESS}
        done += len(wcs)
    assert any(partial), "the socket took every doorbell write whole: the partial path was not exercised"
    assert np.array_equal(pair.b.buf[: n * chunk], pair.a.buf[: n * chunk])


def test_a_read_into_a_region_deregistered_while_queued_moves_no_byte(pairs: PairFactory) -> None:
    """A READ whose local region is deregistered while it waits behind a stalled one: its payload
    is drained, never written; it fails LOC_PROT_ERR (LOCAL_DEREGISTERED), the rest flush."""
    stall = threading.Event()
    entered = threading.Event()

    class StallFirst(Hooks):
        def on_request(self, qp_num: int, opcode: int, rkey: int, remote_addr: int, length: int) -> None:
            if not entered.is_set():
                entered.set()
                stall.wait(WAIT)

    pair = pairs()
    pair.b.qp.hooks = StallFirst()  # type: ignore[attr-defined]
    doomed = np.zeros(1 << 16, np.uint8)
    mr = pair.a.register(doomed, Access.all())
    pair.a.qp.post_send([pair.read(0, 0, 4096, 0)])  # held at the target
    assert entered.wait(WAIT)
    pair.a.qp.post_send([pair.read(1, 0, 1 << 16, 0, local_mr=mr), pair.read(2, 4096, 4096, 0)])
    pair.a.deregister(mr)  # nothing pins it: the READ into it is only queued
    stall.set()
    wcs = pair.waiter.wait(3)
    assert wr_ids(wcs) == [0, 1, 2]
    assert statuses(wcs) == [WcStatus.SUCCESS, WcStatus.LOC_PROT_ERR, WcStatus.WR_FLUSH_ERR]
    assert wcs[1].vendor_err == VendorErr.LOCAL_DEREGISTERED
    time.sleep(0.05)
    assert not doomed.any(), "a READ response landed in a deregistered region"


def test_vectored_io_survives_partial_writes_and_reads() -> None:
    """send_all/recv_all over iovec arrays of many blocks, with a send buffer far smaller than
    the data: every partial call resumes at the right byte (advance), and prefix cuts exactly."""
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    lengths = rng.integers(0, 3000, 700).astype(np.uint64)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.uint64)
    total = int(lengths.sum())
    a, b = socket.socketpair()
    with a, b:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        send = iov.iovecs(len(lengths))
        send[:, 0] = offsets + np.uint64(src.ctypes.data)
        send[:, 1] = lengths
        recv = iov.iovecs(len(lengths))
        recv[:, 0] = offsets[::-1].copy() + np.uint64(dst.ctypes.data)  # scattered differently
        recv[:, 1] = lengths[::-1]
        cut = iov.prefix(recv, 0, total - 1)
        assert int(cut[:, 1].sum()) == total - 1 and len(cut) <= len(recv)
        writer = threading.Thread(target=iov.send_all, args=(a.fileno(), send, total))
        writer.start()
        iov.recv_all(b.fileno(), recv, total)
        writer.join()
    sent = np.concatenate([src[int(o) : int(o + n)] for o, n in zip(offsets, lengths, strict=True)])
    got = np.concatenate([dst[int(o) : int(o + n)] for o, n in zip(offsets[::-1], lengths[::-1], strict=True)])
    assert np.array_equal(sent, got)


def test_a_fault_plan_given_in_the_tcp_options_applies(pairs: PairFactory) -> None:
    """``TcpOptions(fault_plan=plan)`` (IOEngineConfig's ``tcp``) hooks every pair the backend makes."""
    plan = FaultPlan((FaultRule(Action.STATUS, qp=0, wr=1, status=WcStatus.REM_OP_ERR),))
    pair = pairs(specific=TcpOptions(fault_plan=plan))
    wcs = pair.run([pair.write(i, i * 4096, 4096, i * 4096) for i in range(3)])
    assert statuses(wcs) == [WcStatus.SUCCESS, WcStatus.REM_OP_ERR, WcStatus.WR_FLUSH_ERR]


def test_fault_settings_are_checked_when_the_options_are_made() -> None:
    with pytest.raises(InvalidArgument, match=r"TcpOptions\.fault_plan"):
        TcpOptions(fault_plan={"rules": []})  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="not both"):
        TcpOptions(fault_plan=FaultPlan(), hooks=Hooks())
    with pytest.raises(InvalidArgument, match=r"TcpOptions\.hooks"):
        open_backend("tcp", make_options(specific=TcpOptions(hooks=object())))  # checked at open
