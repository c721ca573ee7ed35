"""The compat layer from many threads at once, and the rules of its loop thread."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import Counter

import numpy as np
import pytest

from moriio_async.compat.mori import IOEngine, MemoryLocationType, RdmaBackendConfig, StatusCode, TransferStatus
from moriio_async.compat.mori.loop import LoopThread, new_event_loop

from .conftest import make_pair, on_loop, register
from .test_inbound import wait_inbound

THREADS = 8
ROUNDS = 25
BLOCK = 4096
BLOCKS = 16  # per thread
SLICE = BLOCK * BLOCKS


@pytest.mark.parametrize(("kind", "env"), [("asyncio", "uvloop"), ("uvloop", "asyncio"), (None, "asyncio")])
def test_a_loop_thread_runs_the_loop_kind_it_is_given_else_the_environments(
    monkeypatch: pytest.MonkeyPatch, kind: str | None, env: str
) -> None:
    monkeypatch.setenv("MORIIO_COMPAT_LOOP", env)
    thread = LoopThread(f"kind-{kind}", kind)
    try:
        assert ("uvloop" in type(thread.loop).__module__) == ((kind or env) == "uvloop")
    finally:
        thread.stop()


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_many_threads_lose_nothing_and_end_each_status_once(monkeypatch: pytest.MonkeyPatch, loop: str) -> None:
    monkeypatch.setenv("MORIIO_COMPAT_LOOP", loop)
    ends: Counter[int] = Counter()
    ends_lock = threading.Lock()
    update = TransferStatus.Update

    def counting_update(self: TransferStatus, code: int, message: str) -> None:
        if code != StatusCode.IN_PROGRESS:
            with ends_lock:
                ends[id(self)] += 1
        update(self, code, message)

    monkeypatch.setattr(TransferStatus, "Update", counting_update)
    a, b = make_pair(f"stress-{loop}", "tcp", RdmaBackendConfig(qp_per_transfer=2))
    try:
        x, mx = register(a, THREADS * SLICE, fill=0)
        y, my = register(b, THREADS * SLICE, fill=0)
        sessions = [a.create_session(mx, my) for _ in range(2)]  # shared by every thread
        issued: list[tuple[int, TransferStatus]] = []
        issued_lock = threading.Lock()
        errors: list[str] = []

        def worker(t: int) -> None:
            base = t * SLICE
            mine: list[tuple[int, TransferStatus]] = []
            for r in range(ROUNDS):
                session = sessions[(t + r) % 2]
                assert session is not None
                x[base : base + SLICE] = (t * 37 + r) % 251 + 1
                offsets = [base + i * BLOCK for i in range(BLOCKS)]
                batch: list[tuple[int, TransferStatus]] = []
                uid = session.allocate_transfer_uid()
                batch.append((uid, session.batch_write(offsets[:8], offsets[:8], [BLOCK] * 8, uid)))
                for off in offsets[8:]:  # engine-level, one block each
                    uid = a.allocate_transfer_uid()
                    batch.append((uid, a.write(mx, off, my, off, BLOCK, uid)))
                if a.wait_all([s for _, s in batch], 20_000) is not StatusCode.SUCCESS:
                    errors.append(f"thread {t} round {r}: {[s.Message() for _, s in batch if not s.Succeeded()]}")
                    return
                if not np.array_equal(x[base : base + SLICE], y[base : base + SLICE]):
                    errors.append(f"thread {t} round {r}: written bytes differ")
                x[base : base + SLICE] = 0
                uid = session.allocate_transfer_uid()
                back = session.batch_read(offsets, offsets, [BLOCK] * BLOCKS, uid)
                back.Wait()
                batch.append((uid, back))
                if not back.Succeeded() or not np.array_equal(x[base : base + SLICE], y[base : base + SLICE]):
                    errors.append(f"thread {t} round {r}: read back {back.Code()} {back.Message()}")
                mine.extend(batch)
            with issued_lock:
                issued.extend(mine)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not errors, errors[:5]
        assert len(issued) == THREADS * ROUNDS * (BLOCKS - 8 + 2)
        uids = [uid for uid, _ in issued]
        assert len(set(uids)) == len(uids), "a uid was handed out twice"
        assert all(s.Succeeded() for _, s in issued)
        assert all(ends[id(s)] == 1 for _, s in issued), "a status ended twice or never"
        assert on_loop(a, lambda: a.aio.outstanding) == 0
        # every transfer is announced to the target exactly once
        assert all(wait_inbound(b, a.key, uid) is not None for uid in uids)
        assert all(b.pop_inbound_transfer_status(a.key, uid) is None for uid in uids)
    finally:
        a.close()
        b.close()


def test_blocking_calls_on_the_loop_thread_raise(pair: tuple[IOEngine, IOEngine]) -> None:
    a, b = pair
    _, mx = register(a, 64)
    _, my = register(b, 64)
    session = a.create_session(mx, my)
    assert session is not None

    def wait_on_loop() -> StatusCode:
        status = session.write(0, 0, 64)  # posting never blocks: fine on the loop
        assert status.InProgress()  # posted after this callback returns
        status.Wait()
        return status.Code()

    with pytest.raises(RuntimeError, match="deadlock"):
        on_loop(a, wait_on_loop)
    for blocking, name in (
        (lambda: a.create_session(mx, my), "IOEngine.create_session"),
        (lambda: a.notify(b.key, b"hi"), "IOEngine.notify"),
        (lambda: a.recv_notification(1), "IOEngine.recv_notification"),
        (lambda: a.wait_all([session.read(0, 0, 8)], 1000), "TransferStatus.Wait/WaitFor"),
        (lambda: a.deregister_memory(mx), "IOEngine.deregister_memory"),
        (session.close, "IOEngineSession.close"),
    ):
        # the error names the call, so the caller knows which one to move off the loop
        with pytest.raises(RuntimeError, match=f"^{re.escape(name)} blocks .* loop's own thread"):
            on_loop(a, blocking)
    # what does not wait for the loop works there, and the engine is still fine afterwards
    desc = on_loop(a, lambda: a.register_torch_tensor(np.zeros(16, dtype=np.uint8)))
    assert desc.size == 16
    assert session.write(0, 0, 64).WaitFor(10_000) is StatusCode.SUCCESS


def test_on_the_loop_thread_a_look_and_a_wait_on_an_ended_status_answer_without_raising(
    held: tuple[IOEngine, IOEngine],
) -> None:
    a, b = held
    _, mx = register(a, 4096)
    _, my = register(b, 4096)
    session = a.create_session(mx, my)
    assert session is not None
    pending = session.write(0, 0, 64)  # held by the mock NIC until stepped
    refused = session.read(0, 0, 1 << 20)  # longer than the regions: ended at once
    answers = on_loop(a, lambda: (pending.WaitFor(0), refused.WaitFor(-1), refused.WaitFor(10)))
    assert answers == (StatusCode.IN_PROGRESS, StatusCode.ERR_INVALID_ARGS, StatusCode.ERR_INVALID_ARGS)
    for stripe in session.stripes:
        on_loop(a, stripe.channel.qp.step, 100)
    assert pending.WaitFor(10_000) is StatusCode.SUCCESS


def test_a_waiting_thread_lets_others_run_while_a_transfer_is_held(held: tuple[IOEngine, IOEngine]) -> None:
    a, b = held
    _, mx = register(a, 4096)
    _, my = register(b, 4096)
    session = a.create_session(mx, my)
    assert session is not None
    status = session.batch_write([0, 2048], [0, 2048], [1024, 1024], 0)
    stop = threading.Event()
    counter = [0]

    def spin() -> None:
        while not stop.is_set():
            counter[0] += 1

    def release() -> None:
        time.sleep(0.2)
        for stripe in session.stripes:
            on_loop(a, stripe.channel.qp.step, 100)

    spinner, releaser = threading.Thread(target=spin), threading.Thread(target=release)
    spinner.start()
    releaser.start()
    cpu = time.thread_time()
    status.Wait()
    cpu = time.thread_time() - cpu
    stop.set()
    spinner.join()
    releaser.join()
    assert status.Succeeded()
    assert counter[0] > 100_000 and cpu < 0.05, (counter[0], cpu)


def test_engines_close_from_any_thread_and_statuses_end(pair: tuple[IOEngine, IOEngine]) -> None:
    a, b = pair
    _, mx = register(a, 64)
    _, my = register(b, 64)
    session = a.create_session(mx, my)
    assert session is not None
    closer = threading.Thread(target=a.close)
    closer.start()
    closer.join(30)
    assert not closer.is_alive()
    status = session.write(0, 0, 8)
    assert status.Code() is StatusCode.ERR_BAD_STATE and not session.alive()
    a.close()  # idempotent


def test_every_engine_call_from_a_user_thread_runs_on_the_loop_thread(pair: tuple[IOEngine, IOEngine]) -> None:
    """The moriio_async engine refuses state-changing calls made off its loop thread (InvalidArgument), so a
    compat call that ran the engine call in the caller's thread would raise here instead of working."""
    a, b = pair
    failures: list[BaseException] = []

    def user_thread() -> None:
        try:
            x, mx = register(a, 4096, fill=3)
            raw = np.zeros(4096, np.uint8)
            mraw = a.register_memory(raw.ctypes.data, raw.nbytes, -1, MemoryLocationType.CPU)
            _, my = register(b, 4096, fill=0)
            a.register_remote_engine(b.get_engine_desc())
            session = a.create_session(mx, my)
            assert session is not None
            uid = a.allocate_transfer_uid()
            assert a.wait_all([session.write(0, 0, 4096, uid)], 10_000) is StatusCode.SUCCESS
            assert a.wait_all([a.read(mraw, 0, my, 0, 64, 99)], 10_000) is StatusCode.SUCCESS
            assert (raw[:64] == 3).all()
            session.close()
            a.deregister_memory(mraw)
            a.deregister_memory(mx)
            a.deregister_remote_engine(b.get_engine_desc())
            assert a.create_session(mx, my) is None  # the remote engine was forgotten
            del x
        except BaseException as exc:
            failures.append(exc)

    worker = threading.Thread(target=user_thread)
    worker.start()
    worker.join(60)
    assert not worker.is_alive()
    assert not failures, failures


def test_an_error_on_the_loop_thread_is_logged_with_its_traceback_and_the_loop_goes_on(
    pair: tuple[IOEngine, IOEngine], caplog: pytest.LogCaptureFixture
) -> None:
    a, b = pair

    def broken() -> None:
        raise ZeroDivisionError("a callback's bug")

    with caplog.at_level(logging.ERROR, logger="moriio_async"):
        a.loop.call_soon_threadsafe(broken)
        deadline = time.monotonic() + 5
        while not caplog.records:
            assert time.monotonic() < deadline, "nothing was logged"
            time.sleep(0.005)
    (record,) = caplog.records
    assert record.name == "moriio_async" and record.levelno == logging.ERROR
    assert record.getMessage().startswith("moriio_async compat loop: Exception in callback")
    assert record.exc_info is not None and isinstance(record.exc_info[1], ZeroDivisionError)
    _, mx = register(a, 64)
    _, my = register(b, 64)
    assert a.write(mx, 0, my, 0, 64).WaitFor(10_000) is StatusCode.SUCCESS


def test_an_unknown_loop_kind_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MORIIO_COMPAT_LOOP", "trio")
    with pytest.raises(ValueError, match=r"^MORIIO_COMPAT_LOOP='trio': choose 'uvloop' or 'asyncio'$"):
        new_event_loop()
