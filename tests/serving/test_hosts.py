"""A fleet on three hosts, each instance given to the proxy by URL: issue #9's "several machines by address".

The prefill and the decode instance run in network namespaces of their own
(``hosts.py``: one bridge, one /24, addresses 10.77.x.2 and .3), the proxy
and the client in this one (.1). Their engines meet by the addresses the
instances listen on, over real sockets between network stacks; with
``backend=auto`` they cannot use cma (another net namespace is another
host to it), so their sessions run over tcp, as between two machines. The
official ``openai`` client checks every completion against the reference.
Needs root and ``ip netns``: skipped with the reason otherwise, and a failure
under CI=true, where both are there.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import httpx
import openai
import pytest

from .fleet import MODEL, MODEL_FLAGS, env, reference
from .hosts import Hosts, hosts_unavailable

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
PROMPTS = ["Hello from another host", "KV blocks cross a bridge: " + "kv " * 30]


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    why = hosts_unavailable()
    if why:
        if IN_CI:
            pytest.fail(f"CI runs as root with iproute2: {why}")
        pytest.skip(why)
    with Hosts(2) as made:
        yield made


class Started:
    """Processes of one fleet, stopped together (SIGTERM, then SIGKILL)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def add(self, proc: subprocess.Popen[str]) -> str:
        """The URL the process printed once it served."""
        self.procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            proc.wait(10)
            raise AssertionError(f"{proc.args!r} exited {proc.returncode} before serving")
        url: str = json.loads(line)["url"]
        return url

    def stop(self) -> list[int | None]:
        """Close every stdin (``--parent-watch``: a graceful stop, exit 0), then wait; SIGKILL a straggler."""
        for proc in self.procs:
            if proc.stdin is not None:
                proc.stdin.close()
        codes: list[int | None] = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(20))
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
                codes.append(proc.wait())
            if proc.stdout is not None:
                proc.stdout.close()
        return codes


def _pipes(log: IO[str]) -> dict[str, Any]:
    """Popen's streams for a fleet process: stdin kept (closing it stops the process), the
    stdout line that says where it serves, the log."""
    return {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": log, "env": env()}


def _role(role: str, host: str, port: int, *args: str) -> list[str]:
    argv = [sys.executable, "-m", "moriio_async.serving", "--log-level", "INFO", role, "--host", host]
    return [*argv, "--port", str(port), "--parent-watch", *MODEL_FLAGS, *args]


@pytest.mark.parametrize("mode", ["read", "write"])
def test_instances_on_other_hosts_are_given_by_url_and_serve_identically(
    hosts: Hosts, mode: str, tmp_path: Path
) -> None:
    fleet = Started()
    logs = {name: (tmp_path / f"{name}.log").open("w") for name in ("prefill", "decode", "proxy")}
    try:
        p_addr, d_addr = hosts.address(0), hosts.address(1)
        prefill_argv = _role("prefill", p_addr, 8100, "--name", "prefill-0", "--backend", "auto")
        decode_argv = _role("decode", d_addr, 8200, "--name", "decode-0", "--backend", "auto")
        prefill = fleet.add(hosts.popen(0, prefill_argv, **_pipes(logs["prefill"])))
        decode = fleet.add(hosts.popen(1, decode_argv, **_pipes(logs["decode"])))
        assert (prefill, decode) == (f"http://{p_addr}:8100", f"http://{d_addr}:8200")
        proxy_argv = _role("proxy", hosts.here, 0, "--prefill", prefill, "--decode", decode, "--mode", mode)
        proxy = fleet.add(subprocess.Popen(proxy_argv, text=True, **_pipes(logs["proxy"])))

        with openai.OpenAI(base_url=f"{proxy}/v1", api_key="unused", max_retries=0, timeout=60) as client:
            for prompt in PROMPTS:
                plain = client.completions.create(model=MODEL.name, prompt=prompt, max_tokens=12)
                streamed = "".join(
                    ch.choices[0].text
                    for ch in client.completions.create(model=MODEL.name, prompt=prompt, max_tokens=12, stream=True)
                    if ch.choices
                )
                assert plain.choices[0].text == streamed == reference(prompt, 12)
                kv = (plain.model_extra or {})["kv_transfer"]
                assert kv["mode"] == mode and kv["bytes"] > 0

        assert httpx.get(f"{proxy}/health", timeout=10).json()["ready"]
        seen = {url: httpx.get(f"{url}/health", timeout=10).json() for url in (prefill, decode)}
        # Each engine listens on its own host's address, and cma (same host only) was not chosen.
        assert seen[prefill]["engine"]["address"].startswith(f"{p_addr}:")
        assert seen[decode]["engine"]["address"].startswith(f"{d_addr}:")
        assert seen[prefill]["backend"] == seen[decode]["backend"] == "tcp"
        assert seen[prefill]["blocks"]["in_flight"] == seen[decode]["blocks"]["in_flight"] == 0
    finally:
        codes = fleet.stop()
        for log in logs.values():
            log.close()
    assert codes == [0, 0, 0], f"exit codes {codes}; logs in {tmp_path}"
