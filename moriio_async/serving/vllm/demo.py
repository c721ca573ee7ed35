"""``./scripts/demo --engine vllm``: a real vLLM prefill/decode pair on moriio_async, checked token for token.

Installs vLLM into a venv of its own on first use (:mod:`.venv`), makes a tiny
local model (:mod:`.tinymodel`), then starts, at once, a plain vLLM (the
reference: the same model and seed, no connector) and, per ``--mode``, a
prefill and a decode vLLM server whose KV moves through vLLM's own MoRIIO
connector on moriio_async (:mod:`moriio_async.integrations.vllm`). Each mode's
pair gets the proxy of :mod:`.proxy` in front; ``--requests`` streamed greedy
completions go through it ``--concurrency`` at a time, and every generation
must equal the reference's. The table is the numpy demo's; KV figures come from
the engines' transfer traces (:mod:`.kvtrace`). ``--kill-prefill`` SIGKILLs the
prefill server mid-run (``--stop-prefill`` SIGSTOPs it for longer than the
transfer timeout instead), checks that every request still ends and that the
decode server serves the next one, then restarts it (or lets it go on) and
checks that it is used again. Every process is stopped on success, failure
and Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec
import uvicorn
from rich.console import Console

from ..launcher import cancel_on_signals, group_alive
from ..messages import KvTransfer
from ..report import KillReport, ModeReport, table_of
from ..workload import Result, make_prompts
from . import venv
from .client import openai_load
from .kvtrace import Span, TraceSummary, covered, load_spans
from .proxy import Peer, VllmProxySettings, create_vllm_proxy_app
from .servers import Server, ServerSpec, VllmFleet, free_port

__all__ = ["VllmDemo", "run_vllm_demo"]

GREEDY = {"temperature": 0.0}


@dataclass
class VllmModeReport(ModeReport):
    trace: TraceSummary | None = None
    spans: list[Span] = field(default_factory=list)

    def figures(self) -> dict[str, str]:
        rows = super().figures()
        t = self.trace
        rows.pop("tokens generated", None)
        rows["characters generated"] = str(sum(len(r.text) for r in self.ok_results()))
        if t is not None:
            rows["KV bytes moved"] = f"{t.nbytes / (1 << 20):.2f} MiB in {t.transfers} transfers ({t.failed} failed)"
            rows["KV transport"] = ", ".join(sorted(t.transports)) or "-"
            rows["transfer GB/s (while in flight)"] = f"{t.nbytes / t.busy / 1e9:.2f}" if t.busy else "-"
        return rows


class VllmDemo:
    def __init__(self, args: argparse.Namespace, run_dir: Path, python: Path, model: Path) -> None:
        self.args, self.run_dir, self.model = args, run_dir, model
        self.trace_dir = run_dir / "trace"
        self.fleet = VllmFleet(
            python,
            run_dir,
            env={"MORIIO_ASYNC_TRACE": str(self.trace_dir)},
            startup_timeout=args.startup_timeout,
        )
        self.console = Console()
        self.err = Console(stderr=True)
        self.client = httpx.AsyncClient(timeout=60.0, limits=httpx.Limits(max_connections=64))

    def pair(self, mode: str) -> tuple[ServerSpec, ServerSpec]:
        common = {"model": self.model, "mode": mode, "transport": self.args.backend, "seed": self.args.seed}
        common["transfer_timeout"] = self.args.transfer_timeout
        return (
            ServerSpec(f"prefill-{mode}", role="kv_producer", **common),
            ServerSpec(f"decode-{mode}", role="kv_consumer", **common),
        )

    async def references(self, ref: Server, prompts: list[str]) -> list[str]:
        async def one(prompt: str) -> str:
            body = {**GREEDY, "model": str(self.model), "prompt": prompt, "max_tokens": self.args.max_tokens}
            resp = await self.client.post(f"{ref.spec.url}/v1/completions", json=body)
            resp.raise_for_status()
            return str(resp.json()["choices"][0]["text"])

        return list(await asyncio.gather(*(one(p) for p in prompts)))

    async def kv_usage(self, srv: Server) -> float:
        """vLLM's own KV cache usage gauge (0 once every request released its blocks); -1 when unreadable."""
        try:
            text = (await self.client.get(f"{srv.spec.url}/metrics", timeout=5.0)).text
        except httpx.HTTPError:
            return -1.0
        for line in text.splitlines():
            if line.startswith("vllm:kv_cache_usage_perc{"):
                return float(line.rsplit(" ", 1)[1])
        return -1.0

    @contextlib.asynccontextmanager
    async def proxy(self, mode: str, prefill: Server, decode: Server) -> AsyncIterator[str]:
        """The proxy for one pair, served in this process; yields its OpenAI base URL."""
        p, d = prefill.spec, decode.spec
        settings = VllmProxySettings(
            prefill=[Peer(p.url, "127.0.0.1", p.handshake_port, p.notify_port)],
            decode=[Peer(d.url, "127.0.0.1", d.handshake_port, d.notify_port)],
            mode=mode,
            transfer_timeout=self.args.transfer_timeout,
        )
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(create_vllm_proxy_app(settings), port=port, log_level="warning"))
        serving = asyncio.create_task(server.serve())
        try:
            while not server.started:
                if serving.done():
                    serving.result()
                await asyncio.sleep(0.05)
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            server.should_exit = True
            await serving

    def load(self, url: str, prompts: list[str], concurrency: int) -> asyncio.Task[list[Result]]:
        a = self.args
        timeout = a.transfer_timeout * 4 + 60
        return asyncio.create_task(openai_load(url, str(self.model), prompts, a.max_tokens, concurrency, timeout))

    async def run_phase(
        self, mode: str, fault: str | None, prefill: Server, decode: Server, prompts: list[str]
    ) -> VllmModeReport:
        """One load through a fresh proxy; with ``fault`` ("killed", "stopped") the prefill server suffers it."""
        label = mode if fault is None else f"{mode}, prefill {fault}"
        report = VllmModeReport(label)
        since = time.monotonic()
        started = time.perf_counter()
        async with self.proxy(mode, prefill, decode) as url:
            load = self.load(url, prompts, self.args.concurrency)
            if fault is not None:
                report.kill = await self.inject(prefill, fault)
            report.results += await load  # every request must end: an answer, a retry or an error
            if fault is not None:
                assert report.kill is not None
                await self.recover(prefill, fault, url, prompts, report, report.kill, time.perf_counter())
        report.wall = time.perf_counter() - started
        report.leaks = await self.blocks_left(prefill, decode)
        report.spans = load_spans(self.trace_dir, since)
        report.trace = TraceSummary.of(report.spans)
        for r in report.results:
            if r.ok and r.ttft:
                r.kv = KvTransfer(exposed_s=covered(report.spans, r.started, r.started + r.ttft))
        return report

    async def blocks_left(self, prefill: Server, decode: Server) -> dict[str, int]:
        """1 for a server whose KV cache is still in use once vLLM's own timeouts have passed, else 0."""
        deadline = time.monotonic() + 4 * self.args.transfer_timeout + 20  # past the servers' defer/abort timeouts
        while True:
            usage = {srv.spec.name: await self.kv_usage(srv) for srv in (prefill, decode)}
            if all(u == 0.0 for u in usage.values()) or time.monotonic() > deadline:
                return {name: int(u != 0.0) for name, u in usage.items()}
            await asyncio.sleep(0.5)

    async def inject(self, prefill: Server, fault: str) -> KillReport:
        """Once requests are in flight, SIGKILL the prefill server (or SIGSTOP it)."""
        kill = KillReport()
        await asyncio.sleep(0.5)
        if fault == "stopped":
            self.fleet.signal(prefill, signal.SIGSTOP)
        else:
            await self.fleet.kill(prefill)
        kill.killed_at = time.perf_counter()
        return kill

    async def recover(
        self,
        prefill: Server,
        fault: str,
        url: str,
        prompts: list[str],
        report: ModeReport,
        kill: KillReport,
        load_ended: float,
    ) -> None:
        """Restart the killed server (or continue the stopped one past the timeout); it must serve again.

        ``load_ended``: when the faulted load's last request ended (every failed attempt came before)."""
        if fault == "stopped":
            left = self.args.transfer_timeout + 1 - (time.perf_counter() - kill.killed_at)
            await asyncio.sleep(max(0.0, left))
            self.fleet.signal(prefill, signal.SIGCONT)
        else:
            await self.fleet.restart(prefill)
        kill.restarted_after = time.perf_counter() - kill.killed_at
        # The proxy leaves a prefill server out for transfer_timeout after its last failed attempt (so no request
        # waits twice on a server that is down), and every failed attempt came before the load ended. Clients
        # that come sooner get a 503 at once; the wave comes once that window is over (a restart outlasts it).
        await asyncio.sleep(max(0.0, self.args.transfer_timeout - (time.perf_counter() - load_ended)))
        wave = await self.load(url, prompts[:4], 1)
        report.results += wave
        kill.served_after_restart = sum(1 for r in wave if r.ok)

    async def main(self) -> int:
        a = self.args
        modes = ["write", "read"] if a.mode == "both" else [a.mode]
        ref_spec = ServerSpec("reference", self.model, seed=a.seed)
        pairs = {mode: self.pair(mode) for mode in modes}
        specs = [ref_spec, *(s for pair in pairs.values() for s in pair)]
        self.err.print(f"starting {len(specs)} vLLM servers (a reference and a pair per mode); logs in {self.run_dir}")
        t0 = time.monotonic()
        servers = {srv.spec.name: srv for srv in await self.fleet.start(specs)}
        self.err.print(f"all healthy after {time.monotonic() - t0:.0f}s")
        prompts = make_prompts(a.requests, a.seed, a.min_prompt, a.max_prompt)
        references = await self.references(servers["reference"], prompts)
        reports = []
        for mode in modes:
            p, d = pairs[mode]
            phases = [None] + (["killed"] if a.kill_prefill else []) + (["stopped"] if a.stop_prefill else [])
            for fault in phases:
                what = f", prefill {fault} mid-run" if fault else ""
                self.err.print(f"{mode.upper()} mode{what}: {a.requests} requests, {a.concurrency} at a time")
                report = await self.run_phase(mode, fault, servers[p.name], servers[d.name], prompts)
                report.check(references, prompts, a.transfer_timeout + 1.0 + _slack(a), 1)
                reports.append(report)
        title = (
            f"1P1D vLLM {venv.VLLM_VERSION} (MoRIIOConnector on moriio_async, transport {a.backend}), tiny Llama, "
            f"{a.requests} requests x {a.max_tokens} tokens, concurrency {a.concurrency}"
        )
        self.console.print(table_of(list(reports), title))
        if a.json is not None:
            a.json.write_text(
                json.dumps(
                    {
                        "passed": all(r.passed for r in reports),
                        "modes": msgspec.to_builtins([r.summary() for r in reports]),
                    },
                    indent=2,
                )
            )
        for report in reports:
            for line in report.problems:
                self.console.print(f"[red]{report.mode.upper()}: {line}[/]")
        return 0 if all(r.passed for r in reports) else 1


def _slack(args: argparse.Namespace) -> float:
    """What a request may take beyond the transfer timeout without being a hang: its own generation."""
    return 10.0


def prepare(args: argparse.Namespace, err: Console) -> tuple[Path, Path]:
    """The vLLM venv's Python (installed on first use) and the tiny model's directory (made on first use)."""
    env = venv.ensure()
    model = args.model_dir or env.root.with_name("tinymodel")
    root = str(Path(__file__).resolve().parents[3])
    err.print(f"vLLM {venv.VLLM_VERSION} in {env.root}; model in {model}")
    subprocess.run(
        [str(env.python), "-m", "moriio_async.serving.vllm.tinymodel", str(model)],
        check=True,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": root},
    )
    return env.python, model


def run_vllm_demo(args: argparse.Namespace) -> int:
    err = Console(stderr=True)
    if args.requests < 1 or args.concurrency < 1 or args.max_tokens < 1:
        err.print("--requests, --concurrency and --max-tokens must be at least 1")
        return 2
    python, model = prepare(args, err)
    run_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="moriio-vllm-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    demo = VllmDemo(args, run_dir, python, model)

    async def guarded() -> int:
        cancel_on_signals()
        try:
            return await demo.main()
        except asyncio.CancelledError:
            err.print("interrupted: stopping every process")
            return 130
        finally:
            await asyncio.shield(demo.fleet.close())
            await demo.client.aclose()
            left = [s.spec.name for s in demo.fleet.servers if s.proc is not None and group_alive(s.proc.pid)]
            if left:
                err.print(f"[red]processes left behind: {left}[/]")
            err.print(f"stopped {len(demo.fleet.servers)} vLLM servers; logs in {run_dir}")

    return asyncio.run(guarded())
