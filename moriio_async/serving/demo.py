"""``./scripts/demo``: a disaggregated fleet started, loaded, checked token for token, and stopped.

Starts ``--prefill N`` prefill and ``--decode M`` decode instances and a proxy
(each its own process and process group), sends ``--requests`` streamed
completions ``--concurrency`` at a time through the proxy in each ``--mode``,
checks every generation against greedy generation in this process (the
reference), and prints a table. The exit status is 0 only when every
generation is identical, no request hung and no instance leaked a block.

The fleet's engines share a secret their hellos prove: ``$MORIIO_ASYNC_SECRET``
if it is set, else one generated for the run (``--serve`` prints it, for engines
that join the fleet); ``--no-secret`` runs them without one.

``--kill-prefill`` SIGKILLs prefill-0 while its KV is in flight, restarts it
after ``--restart-delay`` seconds (a new incarnation on the same port), and then
checks that it serves again. ``--serve`` leaves the proxy up for real clients.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .config import add_model_args, add_timeout_args, model_config
from .launcher import SECRET_ENV, Child, Launcher, cancel_on_signals, group_alive
from .messages import EndpointInfo, InstanceHealth, ProxyHealth
from .model import Model, decode_text, encode
from .report import KillReport, ModeReport, render_table
from .vllm.args import add_vllm_args
from .workload import Result, make_prompts, run_load

__all__ = ["add_demo_parser", "fleet_secret", "run_demo"]


def add_demo_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo",
        help="start a fleet, load it, check every token",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--engine",
        choices=["numpy", "vllm"],
        default="numpy",
        help="numpy: this package's own model and instances; vllm: real vLLM servers with vLLM's MoRIIO connector",
    )
    p.add_argument("--prefill", type=int, default=1, help="prefill instances")
    p.add_argument("--decode", type=int, default=1, help="decode instances")
    p.add_argument("--mode", choices=["read", "write", "both"], default="both", help="vLLM MoRIIO's read_mode")
    p.add_argument(
        "--backend",
        default="auto",
        help="auto (cma when instances share the host, else verbs, else tcp), tcp, verbs or cma",
    )
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--min-prompt", type=int, default=128, help="prompt length in bytes (tokens)")
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-blocks", type=int, default=0, help="KV blocks per instance (0: 4 max-length sequences)")
    p.add_argument("--kill-prefill", action="store_true", help="SIGKILL prefill-0 mid-transfer, then restart it")
    p.add_argument("--restart-delay", type=float, default=1.0)
    p.add_argument("--serve", action="store_true", help="leave the proxy up for real clients (Ctrl-C stops)")
    p.add_argument(
        "--no-secret",
        action="store_true",
        help=f"run the engines without a shared secret (default: ${SECRET_ENV}, else one generated for the run)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="the proxy's port")
    p.add_argument("--log-dir", type=Path, default=None, help="children's logs (default: a temporary directory)")
    p.add_argument("--json", type=Path, default=None, help="also write the results to this file, as JSON")
    add_model_args(p)
    add_timeout_args(p)
    add_vllm_args(p)
    p.set_defaults(transfer_timeout=5.0)


class Demo:
    def __init__(self, args: argparse.Namespace, log_dir: Path) -> None:
        self.args = args
        self.model_config = model_config(args)
        self.secret = fleet_secret(args.no_secret)
        self.launcher = Launcher(log_dir, self.secret)
        self.console = Console()
        self.err = Console(stderr=True)
        self.prefills: list[Child] = []
        self.decodes: list[Child] = []
        self.client = httpx.AsyncClient(timeout=10.0, limits=httpx.Limits(max_connections=256))

    # -- the fleet -----------------------------------------------------------------------------------

    def _common(self) -> list[str]:
        a, c = self.args, self.model_config
        flags = ["--model-name", c.name, "--d-model", str(c.d_model), "--layers", str(c.n_layers)]
        flags += ["--heads", str(c.n_heads), "--d-ff", str(c.d_ff), "--block-size", str(c.block_size)]
        flags += ["--max-model-len", str(c.max_model_len), "--model-seed", str(c.seed)]
        flags += ["--transfer-timeout", str(a.transfer_timeout), "--control-timeout", str(a.control_timeout)]
        return [*flags, "--admission-timeout", str(a.admission_timeout)]

    async def start_instances(self) -> None:
        a = self.args
        extra = [*self._common(), "--backend", a.backend, "--host", a.host]
        if a.num_blocks:
            extra += ["--num-blocks", str(a.num_blocks)]
        spawns = [self.launcher.spawn("prefill", f"prefill-{i}", extra) for i in range(a.prefill)]
        spawns += [self.launcher.spawn("decode", f"decode-{i}", extra) for i in range(a.decode)]
        children = await asyncio.gather(*spawns)
        self.prefills = [c for c in children if c.role == "prefill"]
        self.decodes = [c for c in children if c.role == "decode"]

    async def start_proxy(self, mode: str, port: int = 0) -> Child:
        flags = [*self._common(), "--mode", mode, "--host", self.args.host]
        for c in self.prefills:
            flags += ["--prefill", c.url]
        for c in self.decodes:
            flags += ["--decode", c.url]
        proxy = await self.launcher.spawn("proxy", f"proxy-{mode}", flags, port)
        await self.wait_fleet(proxy, lambda e: True)
        return proxy

    async def wait_fleet(
        self, proxy: Child, want: Callable[[EndpointInfo], bool], timeout: float = 30.0
    ) -> ProxyHealth:
        """The proxy's /health once every instance is healthy and ``want(instance)`` holds for all."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(httpx.HTTPError, msgspec.DecodeError):
                body = msgspec.json.decode((await self.client.get(f"{proxy.url}/health")).content, type=ProxyHealth)
                if all(e.healthy and want(e) for e in body.instances):
                    return body
            if time.monotonic() > deadline:
                raise RuntimeError(f"the fleet did not become healthy in {timeout:g}s")
            await asyncio.sleep(0.05)

    async def health(self, child: Child) -> InstanceHealth | None:
        try:
            resp = await self.client.get(f"{child.url}/health", timeout=2.0)
            return msgspec.json.decode(resp.content, type=InstanceHealth)
        except (httpx.HTTPError, msgspec.DecodeError):
            return None

    async def blocks_in_use(self) -> dict[str, int]:
        """Allocated blocks per instance once they drain (``transfer_timeout`` + 1 s at most)."""
        deadline = time.monotonic() + self.args.transfer_timeout + 1.0
        while True:
            used: dict[str, int] = {}
            for c in self.prefills + self.decodes:
                h = await self.health(c)
                used[c.name] = -1 if h is None else h.blocks["allocated"] + h.blocks["in_flight"]
            if not any(used.values()) or time.monotonic() > deadline:
                return used
            await asyncio.sleep(0.05)

    # -- a mode --------------------------------------------------------------------------------------

    async def run_mode(self, mode: str, prompts: list[str]) -> ModeReport:
        a = self.args
        proxy = await self.start_proxy(mode)
        report = ModeReport(mode)
        done: list[Result] = []
        timeout = 4 * a.transfer_timeout + 60
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[tok]} tokens"),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=self.err, transient=False) as progress:
            task = progress.add_task(f"{mode.upper()} {a.prefill}P{a.decode}D", total=len(prompts), tok=0)

            quarter = asyncio.Event()  # a quarter of the requests ended: time to kill prefill-0

            def on_done(r: Result) -> None:
                done.append(r)
                progress.update(task, advance=1, tok=sum(len(x.text) for x in done))
                if len(done) >= len(prompts) // 4:
                    quarter.set()

            started = time.perf_counter()
            load = asyncio.create_task(
                run_load(
                    self.client,
                    proxy.url,
                    self.model_config.name,
                    prompts,
                    a.max_tokens,
                    a.concurrency,
                    timeout,
                    on_done,
                )
            )
            if a.kill_prefill:
                report.kill = await self.kill_and_restart(quarter, load)
            report.results = await load
            report.wall = time.perf_counter() - started
        if a.kill_prefill and report.kill is not None:
            await self.after_restart(proxy, prompts, report)
        report.leaks = await self.blocks_in_use()
        for c in self.prefills + self.decodes:
            h = await self.health(c)
            if h is not None:
                report.transports.add(h.backend)
        await self.launcher.stop(proxy)
        return report

    async def kill_and_restart(self, quarter: asyncio.Event, load: asyncio.Task[Any]) -> KillReport:
        """SIGKILL prefill-0 while blocks of its are in flight, then start it again on its port."""
        victim, kill = self.prefills[0], KillReport()
        await asyncio.wait([asyncio.ensure_future(quarter.wait()), load], return_when=asyncio.FIRST_COMPLETED)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and not load.done():
            h = await self.health(victim)
            if h is not None and h.blocks["in_flight"] > 0:
                kill.in_flight_blocks = h.blocks["in_flight"]
                break
            await asyncio.sleep(0.001)
        else:
            kill.notes.append("prefill-0 had no blocks in flight when killed")
        await self.launcher.kill(victim)
        kill.killed_at = time.perf_counter()
        await asyncio.sleep(self.args.restart_delay)
        await self.launcher.restart(victim)
        kill.restarted_after = time.perf_counter() - kill.killed_at
        return kill

    async def after_restart(self, proxy: Child, prompts: list[str], report: ModeReport) -> None:
        """Once the proxy sees the new prefill-0, send a few requests one by one: it must serve some."""
        assert report.kill is not None
        victim = self.prefills[0]
        fresh = await self.health(victim)
        incarnation = fresh.engine.incarnation if fresh else None
        await self.wait_fleet(proxy, lambda e: e.url != victim.url or e.incarnation == incarnation)
        n = 2 * len(self.prefills) + 2
        wave = await run_load(
            self.client, proxy.url, self.model_config.name, prompts[:n], self.args.max_tokens, 1, 60.0
        )
        report.results += wave
        h = await self.health(victim)
        report.kill.served_after_restart = h.requests_served if h else 0

    # -- the whole run -------------------------------------------------------------------------------

    async def serve(self) -> int:
        mode = "write" if self.args.mode == "both" else self.args.mode
        proxy = await self.start_proxy(mode, self.args.port)
        c = self.model_config
        print(f"serving at {proxy.url}", flush=True)
        self.err.print(
            f"OpenAI completions API, model [bold]{c.name}[/], {mode.upper()} mode, "
            f"{len(self.prefills)}P{len(self.decodes)}D; try:\n  curl {proxy.url}/v1/completions "
            f'-H \'content-type: application/json\' -d \'{{"model": "{c.name}", "prompt": "Hello", "max_tokens": 16}}\''
            "\nCtrl-C stops everything."
        )
        if self.secret is None:
            self.err.print("[yellow]the engines accept unauthenticated peers (--no-secret)[/]")
        elif self.secret == os.environ.get(SECRET_ENV):
            self.err.print(f"the engines prove the shared secret in ${SECRET_ENV}")
        else:  # generated: an engine that joins the fleet needs it
            join = f"the engines prove a secret generated for this run; to join: export {SECRET_ENV}={self.secret}"
            self.err.print(join, markup=False, highlight=False, soft_wrap=True)  # one line, to copy as it is
        assert proxy.proc is not None
        await proxy.proc.wait()
        return 1  # the proxy died on its own

    async def main(self) -> int:
        a = self.args
        await self.start_instances()
        if a.serve:
            return await self.serve()
        modes = ["write", "read"] if a.mode == "both" else [a.mode]
        prompts = make_prompts(a.requests, a.seed, a.min_prompt, a.max_prompt)
        reports = [await self.run_mode(mode, prompts) for mode in modes]
        self.err.print("computing the single-process reference ...")
        model = Model(self.model_config)
        references = await asyncio.to_thread(
            lambda: [decode_text(model.generate(encode(p), a.max_tokens)) for p in prompts]
        )
        ok = True
        for report in reports:
            report.check(references, prompts, a.transfer_timeout + 1.0, a.prefill)
            ok &= report.passed
        self.console.print(render_table(reports, a, self.model_config))
        if a.json is not None:
            a.json.write_text(
                json.dumps({"passed": ok, "modes": msgspec.to_builtins([r.summary() for r in reports])}, indent=2)
            )
        for report in reports:
            for line in report.problems:
                self.console.print(f"[red]{report.mode.upper()}: {line}[/]")
        return 0 if ok else 1


def fleet_secret(off: bool) -> str | None:
    """The fleet's shared secret: none if ``off``, else ``$MORIIO_ASYNC_SECRET``, else a fresh random one."""
    if off:
        return None
    return os.environ.get(SECRET_ENV) or secrets.token_urlsafe(32)


def run_demo(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        from .vllm.demo import run_vllm_demo  # imports nothing of vLLM's: vLLM runs in its own venv

        return run_vllm_demo(args)
    longest = args.max_prompt + 1 + args.max_tokens  # the BOS token, the prompt's bytes, the completion
    if not args.serve and (not 0 < args.min_prompt <= args.max_prompt or longest > args.max_model_len):
        sys.exit(
            f"prompts of {args.min_prompt}..{args.max_prompt} bytes plus {args.max_tokens} tokens "
            f"must fit in --max-model-len {args.max_model_len}"
        )
    if args.prefill < 1 or args.decode < 1 or args.requests < 1 or args.concurrency < 1 or args.max_tokens < 1:
        sys.exit("--prefill, --decode, --requests, --concurrency and --max-tokens must be at least 1")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="moriio-serving-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    demo = Demo(args, log_dir)

    async def guarded() -> int:
        cancel_on_signals()
        code = 1
        try:
            code = await demo.main()
        except asyncio.CancelledError:
            demo.err.print("interrupted: stopping every process")
            code = 130
        finally:
            statuses = await asyncio.shield(demo.launcher.close())
            await demo.client.aclose()
        left = [c.name for c in demo.launcher.children if c.pid is not None and group_alive(c.pid)]
        if left:
            demo.err.print(f"[red]processes left behind: {left}[/]")
        # uvicorn re-raises the SIGTERM it shut down on: -SIGTERM is a clean stop.
        unclean = {n: c for n, c in statuses.items() if c not in (0, -signal.SIGTERM)}
        if unclean:
            demo.err.print(f"[red]processes that did not stop cleanly: {unclean}[/]")
        demo.err.print(f"stopped {len(statuses)} processes; logs in {log_dir}")
        return code or int(bool(left or unclean))

    try:
        import uvloop
    except ImportError:
        return asyncio.run(guarded())
    return uvloop.run(guarded())
