from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from ..conftest import engine_backends

TARGET = Path(__file__).with_name("target.py")


class Target:
    """A target engine in a child process."""

    def __init__(self, proc: asyncio.subprocess.Process, address: str) -> None:
        self.proc = proc
        self.address = address

    async def call(self, **msg: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps(msg) + "\n").encode())
        await self.proc.stdin.drain()
        line = await asyncio.wait_for(self.proc.stdout.readline(), 60)
        assert line, f"target exited (status {self.proc.returncode})"
        reply: dict[str, Any] = json.loads(line)
        return reply

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()


async def start_target(backend: str, **env: str) -> Target:
    """A target process; ``env`` adds to (or overrides) this process's environment."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(TARGET),
        backend,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(TARGET.parents[2]), **env},
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 60)
    return Target(proc, json.loads(line)["address"])


def process_backends() -> list[str]:
    return [b for b in engine_backends() if b != "mock"]  # mock cannot cross processes


@pytest.fixture(params=process_backends())
async def target(request: pytest.FixtureRequest) -> AsyncIterator[Target]:
    t = await start_target(str(request.param))
    try:
        yield t
    finally:
        t.kill()
        await t.proc.wait()
