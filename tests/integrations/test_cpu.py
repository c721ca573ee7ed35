"""integrations.cpu: the AMX tile permission request, as Linux answers it here."""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import pytest

from moriio_async.integrations import cpu


@pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64", reason="x86-64 Linux only")
def test_the_request_matches_what_the_cpu_offers() -> None:
    has_amx = "amx_tile" in Path("/proc/cpuinfo").read_text()
    # Granted where the CPU has AMX tiles (this kernel, 6.x, knows them), refused quietly elsewhere.
    assert cpu.request_amx_permission() is has_amx
    assert cpu.request_amx_permission() is has_amx  # asking twice is harmless


def test_elsewhere_nothing_is_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu.platform, "machine", lambda: "aarch64")
    assert cpu.request_amx_permission() is False
