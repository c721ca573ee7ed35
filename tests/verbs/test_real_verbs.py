"""The verbs backend on a real device (Soft-RoCE in the guest): what only real verbs can prove.

Software emulation is slow (a 4 KiB write takes about a millisecond), so each
test proves one behaviour with as little traffic as that needs.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import select
import time

import pytest

from moriio_async.aio.cq_reader import CompletionReader
from moriio_async.backends.base import Backend, QpState, SendQueueFull
from moriio_async.backends.described import VerbsFacts
from moriio_async.status import Access, Opcode, WcStatus
from moriio_async.work import Sge, WorkCompletion, WorkRequest

from .conftest import Pair, connect, drain, guest_only, write

pytestmark = guest_only


def test_describe_names_device_and_roce_v2_ipv4_gid(backend: Backend) -> None:
    facts = backend.describe()
    assert isinstance(facts, VerbsFacts) and facts.backend == "verbs"
    assert facts.port_state == "ACTIVE"
    assert facts.gid_type == "RoCE v2"
    assert ipaddress.IPv6Address(facts.gid).ipv4_mapped is not None, facts
    assert "RoCE v2" in facts.gid_reason
    assert facts.completion_channel_fd is True
    assert facts.async_events is True, "the async-event fd was not found"


def test_send_queue_depth_is_clipped_to_max_qp_wr() -> None:
    from moriio_async.backends import open_backend

    from .conftest import guest_options

    backend = open_backend("verbs", guest_options(sq_depth=1 << 22, max_sge=1 << 10))
    try:
        cq = backend.create_cq(1 << 22)
        qp = backend.create_qp(cq)
        facts = backend.describe()
        # Clipped to max_qp_wr (less the fence's slot), then halved while the queue does not fit
        # in memory: rxe says 1M, and 1M WQEs of 32 SGEs do not fit in the guest.
        assert isinstance(facts, VerbsFacts)
        assert 1024 <= qp.max_send_wr <= facts.max_qp_wr
        assert qp.max_sge == facts.max_sge
        qp.close()
        cq.close()
    finally:
        backend.close()


def test_write_and_read_with_sge_lists_and_selective_signaling(pair: Pair) -> None:
    p = pair
    chunk = 4096
    # Three scattered source pieces into one remote range, unsignaled, then a signaled one.
    sges = tuple(Sge(p.src.addr + i * 3 * chunk, chunk, p.src.lkey) for i in range(3))
    wr1 = WorkRequest(1, Opcode.RDMA_WRITE, sges, p.dst.addr, p.dst.rkey, signaled=False)
    wr2 = write(2, p.src, p.dst.addr + 3 * chunk, p.dst.rkey, chunk, offset=16 * chunk)
    p.active.post_send([wr1, wr2])
    wcs = drain(p.cq, 1, 10)
    assert [(w.wr_id, w.status, w.opcode, w.byte_len) for w in wcs] == [(2, WcStatus.SUCCESS, Opcode.RDMA_WRITE, chunk)]
    expected = b"".join(bytes(p.src_buf[i * 3 * chunk : i * 3 * chunk + chunk]) for i in range(3))
    assert bytes(p.dst_buf[: 3 * chunk]) == expected
    assert bytes(p.dst_buf[3 * chunk : 4 * chunk]) == bytes(p.src_buf[16 * chunk : 17 * chunk])
    # READ back from the target into another part of the source region.
    read = WorkRequest(
        3, Opcode.RDMA_READ, (Sge(p.src.addr + 64 * chunk, 2 * chunk, p.src.lkey),), p.dst.addr, p.dst.rkey
    )
    p.active.post_send([read])
    (wc,) = drain(p.cq, 1, 10)
    assert (wc.wr_id, wc.status, wc.opcode, wc.byte_len) == (3, WcStatus.SUCCESS, Opcode.RDMA_READ, 2 * chunk)
    assert bytes(p.src_buf[64 * chunk : 66 * chunk]) == bytes(p.dst_buf[: 2 * chunk])


def test_send_queue_full_posts_nothing_and_slots_return_on_poll(pair: Pair) -> None:
    p = pair
    depth = p.active.max_send_wr
    batch = [write(i, p.src, p.dst.addr, p.dst.rkey, 64, signaled=(i == depth - 1)) for i in range(depth)]
    p.active.post_send(batch)
    with pytest.raises(SendQueueFull):
        p.active.post_send([write(10_000, p.src, p.dst.addr, p.dst.rkey, 64)])
    (wc,) = drain(p.cq, 1, 30)
    assert (wc.wr_id, wc.status) == (depth - 1, WcStatus.SUCCESS)
    p.active.post_send([write(10_001, p.src, p.dst.addr, p.dst.rkey, 64)])  # every slot came back
    assert [w.wr_id for w in drain(p.cq, 1, 10)] == [10_001]


def test_to_error_flushes_every_outstanding_request_including_unsignaled(pair: Pair) -> None:
    p = pair
    # rxe runs the requester inside ibv_post_send, so on a live loopback pair a request is
    # done before post_send returns. To have requests outstanding, the responder must not
    # answer: with the passive pair in ERR it drops them, and the active side waits for ACKs
    # (qp_timeout 12: ~17 ms per try, 3 retries) -- long enough to flush them ourselves.
    p.passive.to_error()
    n = 16
    ids = list(range(100, 100 + n))
    p.active.post_send([write(i, p.src, p.dst.addr, p.dst.rkey, 4096, signaled=(i == ids[-1])) for i in ids])
    p.active.to_error()
    assert p.active.state == QpState.ERR
    wcs = drain(p.cq, n, 20)
    assert [w.wr_id for w in wcs] == ids, [(w.wr_id, w.status.name) for w in wcs]
    assert all(w.status is WcStatus.WR_FLUSH_ERR for w in wcs), [w.status.name for w in wcs]
    assert all(w.opcode is Opcode.RDMA_WRITE and w.qp_num == p.active.qp_num for w in wcs)
    # Posting on the errored pair: flushed too, in order.
    p.active.post_send([write(999, p.src, p.dst.addr, p.dst.rkey, 64, signaled=False)])
    (late,) = drain(p.cq, 1, 10)
    assert (late.wr_id, late.status) == (999, WcStatus.WR_FLUSH_ERR)


def test_wrong_rkey_is_remote_access_error_and_flushes_the_rest(pair: Pair) -> None:
    p = pair
    before = bytes(p.dst_buf[:4096])
    p.active.post_send(
        [
            write(1, p.src, p.dst.addr, p.dst.rkey ^ 0x5A5A00, 4096, signaled=False),
            write(2, p.src, p.dst.addr, p.dst.rkey, 4096, signaled=False),
        ]
    )
    wcs = drain(p.cq, 2, 20)
    assert [(w.wr_id, int(w.status)) for w in wcs] == [(1, 10), (2, int(WcStatus.WR_FLUSH_ERR))]
    assert wcs[0].status is WcStatus.REM_ACCESS_ERR
    assert bytes(p.dst_buf[:4096]) == before


def test_deregistered_remote_region_is_remote_access_error(backend: Backend, pair: Pair) -> None:
    p = pair
    victim_buf = bytearray(8192)
    victim = backend.register_memory(memoryview(victim_buf), Access.all())
    p.active.post_send([write(1, p.src, victim.addr, victim.rkey, 4096)])
    assert [w.status for w in drain(p.cq, 1, 10)] == [WcStatus.SUCCESS]
    victim_buf[:] = bytes(8192)
    backend.deregister_memory(victim)
    p.active.post_send([write(2, p.src, victim.addr, victim.rkey, 4096)])
    (wc,) = drain(p.cq, 1, 10)
    assert (wc.wr_id, wc.status) == (2, WcStatus.REM_ACCESS_ERR)
    assert victim_buf == bytes(8192)


def test_region_without_remote_read_refuses_reads(backend: Backend, pair: Pair) -> None:
    p = pair
    target = bytearray(4096)
    region = backend.register_memory(memoryview(target), Access.LOCAL_WRITE | Access.REMOTE_WRITE)
    read = WorkRequest(1, Opcode.RDMA_READ, (Sge(p.src.addr, 4096, p.src.lkey),), region.addr, region.rkey)
    p.active.post_send([read])
    (wc,) = drain(p.cq, 1, 10)
    assert wc.status is WcStatus.REM_ACCESS_ERR


async def test_no_missed_wakeup_over_the_real_completion_channel(pair: Pair) -> None:
    """The runtime's reader on the real channel: bursts posted from callbacks while it drains."""
    p = pair
    loop = asyncio.get_running_loop()
    seen: list[WorkCompletion] = []
    done, room = asyncio.Event(), asyncio.Event()
    total, per_burst = 300, 3

    def dispatch(wcs: list[WorkCompletion]) -> None:
        seen.extend(wcs)
        room.set()
        if len(seen) >= total:
            done.set()

    reader = CompletionReader(loop, p.cq, dispatch)
    reader.start()
    try:
        next_id = 0
        while next_id < total:
            burst = [write(next_id + k, p.src, p.dst.addr, p.dst.rkey, 64) for k in range(per_burst)]
            p.active.post_send(burst)
            next_id += per_burst
            # Vary the gap so posts land before, during and after the reader's re-arm.
            await asyncio.sleep(0 if next_id % 2 else 0.0005)
            while next_id - len(seen) > p.active.max_send_wr - per_burst:
                room.clear()
                await asyncio.wait_for(room.wait(), 30)
        await asyncio.wait_for(done.wait(), 60)
    finally:
        reader.close()
    assert sorted(w.wr_id for w in seen) == list(range(total))
    assert all(w.ok for w in seen)
    stats = reader.statistics()
    assert not stats.fallback_polling
    assert stats.wakeups > 0


def test_epoll_fd_wakes_for_made_up_completions(pair: Pair) -> None:
    """A kill from another thread (as the event watcher does) wakes a reader sleeping on fileno()."""
    import threading

    p = pair
    p.active.to_error()
    drain(p.cq, 0, 0.1)
    p.cq.req_notify()
    p.cq.get_event()
    p.active.post_send([write(7, p.src, p.dst.addr, p.dst.rkey, 64, signaled=False)])
    # The post on an errored pair reached the hardware or the ledger: either way the fd must wake.
    assert select.select([p.cq.fileno()], [], [], 10)[0], "fileno() never became readable"
    (wc,) = drain(p.cq, 1, 10)
    assert (wc.wr_id, wc.status) == (7, WcStatus.WR_FLUSH_ERR)
    kill = getattr(p.cq, "request_kill")  # noqa: B009 - backend-specific hook
    p.cq.get_event()
    timer = threading.Timer(0.2, kill, args=(p.active.qp_num,))
    timer.start()
    started = time.monotonic()
    assert select.select([p.cq.fileno()], [], [], 10)[0]
    assert time.monotonic() - started >= 0.15
    timer.join()


def test_second_pair_after_a_failure_works(backend: Backend, pair: Pair) -> None:
    p = pair
    p.active.to_error()
    drain(p.cq, 0, 0.1)
    active, _passive = connect(backend, p.cq)
    active.post_send([write(5, p.src, p.dst.addr, p.dst.rkey, 4096)])
    (wc,) = drain(p.cq, 1, 10)
    assert (wc.wr_id, wc.status, wc.qp_num) == (5, WcStatus.SUCCESS, active.qp_num)


def test_doctor_on_real_verbs_shows_gid_choice_and_loopback() -> None:
    from moriio_async.cli import doctor

    lines: list[str] = []
    args = argparse.Namespace(backend="verbs", device=None, port=1, host="127.0.0.1", no_loopback=False)
    assert doctor.run(args, out=lines.append) == 0, "\n".join(lines)
    text = "\n".join(lines)
    assert "CompChannel.fd: yes" in text
    assert "<- default" in text
    assert "verbs backend: loopback RDMA WRITE of 4096 bytes verified" in text
    assert "FAIL" not in text
