"""Test-wide settings: every async test runs on asyncio and on uvloop, and an
exception that reaches the event loop's handler fails the test instead of
being printed and forgotten."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import pytest
import uvloop
from hypothesis import HealthCheck, settings

settings.register_profile("default", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("nightly", max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# scripts/mutation: the same examples for every mutant, so a score does not move between runs.
settings.register_profile(
    "mutation",
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
# Inside the Soft-RoCE guest everything runs 25-45x slower: a few examples prove the property there.
settings.register_profile(
    "guest", max_examples=5, deadline=None, database=None, suppress_health_check=list(HealthCheck)
)  # the guest sees the work tree read-only: no example database
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE") or ("guest" if os.environ.get("MORIIO_GUEST") == "1" else "default")
)


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, Callable[[], Any]]:
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.fixture(autouse=True)
async def _loop_errors_fail_the_test() -> AsyncIterator[None]:
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    yield
    loop.set_exception_handler(None)
    assert not errors, f"the event loop saw unhandled errors: {errors}"


def engine_backends() -> list[str]:
    """Backends the engine-level suite runs against (MORIIO_TEST_ENGINE_BACKENDS, comma list)."""
    return [b for b in os.environ.get("MORIIO_TEST_ENGINE_BACKENDS", "mock,tcp,cma").split(",") if b]
