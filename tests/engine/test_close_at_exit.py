"""An engine closed while executors refuse work (the interpreter is exiting: concurrent.futures' exit hook has
run) still closes its backends, instead of failing with "cannot schedule new futures after shutdown"."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

from moriio_async import IOEngine, IOEngineConfig


@pytest.mark.parametrize("backend", ["tcp", "cma"])
async def test_close_when_executors_refuse_work_still_closes_the_backends(backend: str) -> None:
    before = set(threading.enumerate())
    engine = await IOEngine("exiting", IOEngineConfig(backend=backend)).start()
    started = {t for t in set(threading.enumerate()) - before if t.name.startswith("moriio-")}
    assert started, "the backend runs no thread of its own: nothing would show that its close ran"
    refusing = concurrent.futures.ThreadPoolExecutor(1)
    refusing.shutdown()  # as every executor is once concurrent.futures' exit hook has run
    loop = asyncio.get_running_loop()
    loop.set_default_executor(refusing)
    try:
        await engine.close()
    finally:
        loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(1))
    assert not [t.name for t in started if t.is_alive()]  # the backend's close ran: its threads are joined
