"""An engine raises the process's soft open-file limit (within the hard limit) to what its link caps may hold
(issue 26: a soft limit of 1,024 stops a target near 500 peers with EMFILE)."""

from __future__ import annotations

import resource
from collections.abc import Iterator

import pytest

from moriio_async import IOEngine, IOEngineConfig
from moriio_async.engine.fdlimit import raise_fd_limit


@pytest.fixture
def low_soft_limit() -> Iterator[int]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        yield hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_soft_limit_is_raised_for_the_links_within_the_hard_limit(low_soft_limit: int) -> None:
    hard = low_soft_limit
    want = min(4 * 100 + 1024, hard)
    assert raise_fd_limit(100) == want
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (want, hard)
    assert raise_fd_limit(10) == want, "never lowered"
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (want, hard)


async def test_an_engine_raises_it_at_start(low_soft_limit: int) -> None:
    async with IOEngine("fd", IOEngineConfig(backend="mock", max_links=300)):
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == min(4 * 300 + 1024, low_soft_limit)
