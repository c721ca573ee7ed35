"""The backend conformance suite: plain synchronous tests, each run against every backend in
MORIIO_TEST_BACKENDS (comma list, default "mock,tcp,cma"); MORIIO_TEST_BACKEND_OPTIONS (JSON) adds
BackendOptions fields, e.g. ``{"device": "rxe0"}`` inside the Soft-RoCE guest.

A test that exercises one backend's own machinery (the TCP backend's fault hooks, its
completion queue internals) is marked ``only_backends("tcp", reason=...)`` and is generated
for those backends only: no skipped copies on the others. Where none of them is under test
(the guest runs verbs only), pytest reports it once as an empty parameter set.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .harness import PairFactory, backend_names


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "only_backends(*names, reason): a backend-specific test, skipped on other backends"
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend_name" in metafunc.fixturenames:
        names = backend_names()
        marker = metafunc.definition.get_closest_marker("only_backends")
        if marker is not None:
            names = [n for n in names if n in marker.args]
        metafunc.parametrize("backend_name", names)


@pytest.fixture
def pairs(backend_name: str) -> Iterator[PairFactory]:
    """``pairs(size_a, size_b, access_b=..., **BackendOptions fields)`` opens a connected pair."""
    factory = PairFactory(backend_name)
    try:
        yield factory
    finally:
        factory.close()
