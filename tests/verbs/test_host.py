"""On a host without RDMA: backend "verbs" says why it cannot run and how to fix it; doctor agrees.

Each check runs in a fresh interpreter with pyverbs blocked from importing
(``sys.modules["pyverbs"] = None``), so it means the same on a machine that
has pyverbs installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(os.environ.get("MORIIO_GUEST") == "1", reason="host-only: the guest has RDMA")

BLOCK = "import sys; sys.modules['pyverbs'] = None\n"


def _python(code: str, prelude: str = BLOCK) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True, timeout=60
    )


def test_open_backend_verbs_without_pyverbs_names_cause_and_fix() -> None:
    result = _python(
        """
        from moriio_async.backends import open_backend
        from moriio_async.backends.base import BackendOptions
        from moriio_async.errors import BackendUnavailable
        try:
            open_backend("verbs", BackendOptions())
        except BackendUnavailable as exc:
            print(exc)
        """
    )
    assert result.returncode == 0, result.stderr
    assert "pyverbs cannot be imported" in result.stdout
    assert "pip install moriio-async[verbs]" in result.stdout
    assert "rdma-core >= 57" in result.stdout
    assert "backend='tcp'" in result.stdout


def test_backend_auto_skips_verbs_with_the_reason_logged() -> None:
    result = _python(
        """
        import logging
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        from moriio_async import IOEngineConfig
        from moriio_async.engine.transports import open_backends
        opened = open_backends(IOEngineConfig(backend="auto"))
        print("opened:", " ".join(type(b).__module__.split(".")[2] for b in opened))
        for b in opened:
            b.close()
        """
    )
    assert "backend=auto: verbs unavailable here (pyverbs cannot be imported" in result.stderr
    assert "verbs" not in result.stdout.split("opened:")[1] and "tcp" in result.stdout


# A stand-in pyverbs that imports and finds no device: what a machine with rdma-core installed and no
# RDMA driver loaded looks like, wherever the test runs.
NO_DEVICE_PYVERBS = """
import sys, types
class PyverbsError(Exception):
    pass
def get_device_list():
    return []
class CompChannel:
    fd = -1
pyverbs = types.ModuleType("pyverbs")
pyverbs.__path__ = []
sys.modules["pyverbs"] = pyverbs
for name, attrs in {"addr": {}, "cq": {"CompChannel": CompChannel}, "device": {"get_device_list": get_device_list},
                    "mr": {}, "pd": {}, "qp": {}, "wr": {}, "pyverbs_error": {"PyverbsError": PyverbsError}}.items():
    module = types.ModuleType("pyverbs." + name)
    module.__dict__.update(attrs)
    sys.modules["pyverbs." + name] = module
    setattr(pyverbs, name, module)
"""


def test_no_device_message_says_how_to_load_soft_roce() -> None:
    result = _python(
        """
        from moriio_async.backends import open_backend
        from moriio_async.backends.base import BackendOptions
        from moriio_async.backends.verbs import probe
        from moriio_async.errors import BackendUnavailable
        try:
            open_backend("verbs", BackendOptions())
        except BackendUnavailable as exc:
            print("open:", exc)
        report = probe()
        print("probe:", report.devices, report.error, report.hint, sep="|")
        """,
        prelude=textwrap.dedent(NO_DEVICE_PYVERBS),
    )
    assert result.returncode == 0, result.stderr
    opened, probed = result.stdout.splitlines()
    assert opened.startswith("open: no RDMA devices found")
    assert "modprobe rdma_rxe && rdma link add rxe0 type rxe netdev eth0" in opened
    assert probed.startswith("probe:|()|no RDMA devices found|") and "modprobe rdma_rxe" in probed


def test_probe_never_raises_and_reports_the_cause() -> None:
    result = _python(
        """
        from moriio_async.backends.verbs import probe
        report = probe()
        print(report.pyverbs_version, report.error, report.hint, sep="|")
        """
    )
    assert result.returncode == 0, result.stderr
    version, error, hint = result.stdout.strip().split("|")
    assert version == "None"
    assert "pyverbs cannot be imported" in error
    assert "pip install" in hint


def _doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return _python(
        f"""
        import sys
        from moriio_async.cli import main
        sys.exit(main(["doctor", *{list(args)!r}]))
        """
    )


def test_doctor_backend_verbs_fails_with_fix_lines() -> None:
    result = _doctor("--backend", "verbs", "--no-loopback")
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout
    assert "FAIL  pyverbs: pyverbs cannot be imported" in out
    assert "fix: pip install moriio-async[verbs]" in out
    assert "memlock limit" in out
    assert out.rstrip().splitlines()[-1].startswith("result: backend=verbs cannot work")


def test_doctor_backend_tcp_does_not_fail_on_missing_verbs() -> None:
    result = _doctor("--backend", "tcp", "--no-loopback")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAIL" not in result.stdout
    assert "warn  pyverbs" in result.stdout


def test_doctor_tcp_loopback_write() -> None:
    result = _doctor("--backend", "tcp")
    assert "tcp backend: loopback RDMA WRITE of 4096 bytes verified" in result.stdout, result.stdout + result.stderr
    assert result.returncode == 0
