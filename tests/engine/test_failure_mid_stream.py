"""The initiator after its target failed a queue pair in the middle of a WRITE stream (issue 23,
item 1), through whole engines: every transfer ends, the initiator's buffer is no longer pinned, so
``deregister_memory`` on it returns at once (it used to block the event loop for ever, on a pin a
partly sent write kept after its pair failed), and ``close`` returns."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

import pytest

from moriio_async import IOEngine, IOEngineConfig, MemoryInUse, TransferError, waiting_for_transfer_complete
from moriio_async.backends.mock import MockBackend

from .conftest import make_pair

pytestmark = pytest.mark.timeout(120)

SIZE = 16 << 20
BLOCK = 64 << 10
WAIT = 20.0


@pytest.mark.parametrize("failure", ["target deregisters", "target closes"])
async def test_a_target_failing_the_pair_mid_stream_leaves_the_initiator_free(backend: str, failure: str) -> None:
    for attempt in range(3):  # the race (a doorbell's partial write against the failure) is timing-bound
        a, b, p = await make_pair(backend, size=SIZE)
        try:
            transfers = []
            for i in range(SIZE // BLOCK):
                if i == 48 + 16 * attempt:
                    if failure == "target deregisters":
                        b.deregister_memory(p.desc_b)
                    else:
                        await b.close()
                transfers.append(p.session.write(i * BLOCK, i * BLOCK, BLOCK))
                if i % 8 == 0:
                    await asyncio.sleep(0)
            with contextlib.suppress(TransferError):
                await waiting_for_transfer_complete(transfers, timeout=WAIT, fail_fast=False)
            assert all(t.Succeeded() or t.Failed() for t in transfers)
            assert any(t.Failed() for t in transfers)
            assert a.pins(p.desc_a) == 0
            try:
                a.deregister_memory(p.desc_a)  # it blocked the loop here (the test then timed out)
            except MemoryInUse:  # allowed by the contract; release_memory then waits, bounded
                await a.release_memory(p.desc_a, timeout=WAIT)
        finally:
            await asyncio.wait_for(a.close(), WAIT)
            await asyncio.wait_for(b.close(), WAIT)


async def test_close_returns_within_its_timeout_while_a_backend_cannot_close(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A backend whose close is stuck (a wedged NIC thread) must not keep the engine's close from
    returning: it is waited for ``abort_timeout``, logged, and left to finish in its thread."""
    wedged = threading.Event()
    real_close = MockBackend.close

    def stuck_close(self: MockBackend) -> None:
        wedged.wait(WAIT * 4)
        real_close(self)

    monkeypatch.setattr(MockBackend, "close", stuck_close)
    engine = await IOEngine("wedged", IOEngineConfig(backend="mock", abort_timeout=0.2)).start()
    try:
        with caplog.at_level(logging.WARNING, "moriio_async"):
            await engine.close()  # it never returned while the backend's close ran
        assert "close still runs" in caplog.text
    finally:
        wedged.set()
