"""What the demo checks and prints: per mode, identity with the reference, latencies, KV transfer, leaks."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import msgspec
from rich.table import Table

from .model import ModelConfig
from .workload import Result, percentile

__all__ = ["ModeReport", "ModeSummary", "render_table", "table_of"]


@dataclass
class KillReport:
    in_flight_blocks: int = 0
    killed_at: float = 0.0
    restarted_after: float = 0.0
    served_after_restart: int = 0
    notes: list[str] = field(default_factory=list)


class ModeSummary(msgspec.Struct, frozen=True, kw_only=True):
    """One mode's verdict as the demo's ``--json`` report writes it."""

    mode: str
    passed: bool
    requests: int
    ok: int
    identical: int
    mismatched: int
    unavailable: int
    failed: int
    hung: int
    retried: int
    """Requests that took more than one attempt."""
    max_latency_s: float
    leaks: dict[str, int]
    """Blocks still in use per instance after the run."""
    kill: KillReport | None
    errors: list[str]
    figures: dict[str, str]
    problems: list[str]


@dataclass
class ModeReport:
    """One mode's run: the results, and once ``check`` ran, the verdict."""

    mode: str
    results: list[Result] = field(default_factory=list)
    wall: float = 0.0
    kill: KillReport | None = None
    leaks: dict[str, int] = field(default_factory=dict)
    identical: int = 0
    mismatched: int = 0
    unavailable: int = 0
    failed: int = 0
    hung: int = 0
    problems: list[str] = field(default_factory=list)
    transports: set[str] = field(default_factory=set)
    """What the instances' sessions moved KV over (their health's ``backend``) at the end of the run."""

    @property
    def passed(self) -> bool:
        return not self.problems

    def check(self, references: list[str], prompts: list[str], hang_bound: float, n_prefill: int) -> None:
        for r in self.results:
            if r.latency > hang_bound:
                self.hung += 1
            if r.ok:
                if r.text == references[r.index]:
                    self.identical += 1
                else:
                    self.mismatched += 1
                    self.problems.append(
                        f"request {r.index} differs from the reference: {r.text!r} != {references[r.index]!r}"
                    )
            elif r.status == 503 and self.kill is not None and n_prefill == 1:
                self.unavailable += 1  # the only prefill instance was down: a clear 503 is the right answer
            else:
                self.failed += 1
                self.problems.append(f"request {r.index} failed: status {r.status}: {r.error[:300]}")
        if self.hung:
            self.problems.append(f"{self.hung} request(s) took longer than {hang_bound:g}s")
        leaked = {name: n for name, n in self.leaks.items() if n}
        if leaked:
            self.problems.append(f"blocks still in use after the run: {leaked}")
        if self.kill is not None and self.kill.served_after_restart < 1:
            self.problems.append("the restarted prefill-0 served no request")

    def summary(self) -> ModeSummary:
        """Counts, figures and problems (``demo --json``: ``msgspec.to_builtins`` of it)."""
        ok = self.ok_results()
        return ModeSummary(
            mode=self.mode,
            passed=self.passed,
            requests=len(self.results),
            ok=len(ok),
            identical=self.identical,
            mismatched=self.mismatched,
            unavailable=self.unavailable,
            failed=self.failed,
            hung=self.hung,
            retried=sum(1 for r in ok if r.kv.attempts > 1),
            max_latency_s=max((r.latency for r in self.results), default=0.0),
            leaks=self.leaks,
            kill=self.kill,
            errors=sorted({f"{r.status}: {r.error[:200]}" for r in self.results if not r.ok}),
            figures=self.figures(),
            problems=self.problems,
        )

    # -- figures ---------------------------------------------------------------------------------

    def ok_results(self) -> list[Result]:
        return [r for r in self.results if r.ok]

    def figures(self) -> dict[str, str]:
        ok = self.ok_results()
        ttft = [r.ttft for r in ok if r.ttft is not None]
        gaps = [g for r in ok for g in r.gaps]
        kv_bytes = sum(r.kv.bytes for r in ok)
        busy = sum(r.kv.transfer_s for r in ok)
        exposed = [(r.kv.exposed_s or 0.0) for r in ok if r.ttft]
        shares = [(r.kv.exposed_s or 0.0) / r.ttft for r in ok if r.ttft]
        retried = sum(1 for r in ok if r.kv.attempts > 1)
        rows = {
            "requests ok / sent": f"{len(ok)} / {len(self.results)}",
            "token-identical to reference": f"{self.identical} / {len(ok)}"
            + ("" if not self.mismatched else f"  ({self.mismatched} MISMATCHED)"),
            "tokens generated": str(sum(len(r.text) for r in ok)),
            "KV bytes moved": _bytes(kv_bytes),
            "KV transport": ", ".join(sorted(self.transports)) or "-",
            "transfer GB/s (while in flight)": f"{kv_bytes / busy / 1e9:.2f}" if busy else "-",
            "TTFT p50 / p99 (ms)": f"{percentile(ttft, 0.5) * 1e3:.1f} / {percentile(ttft, 0.99) * 1e3:.1f}",
            "inter-token p50 / p99 (ms)": f"{percentile(gaps, 0.5) * 1e3:.2f} / {percentile(gaps, 0.99) * 1e3:.2f}",
            "KV share of TTFT all/p50/p99": (
                f"{sum(exposed) / sum(ttft) * 100:.1f}%/{percentile(shares, 0.5) * 100:.1f}%/"
                f"{percentile(shares, 0.99) * 100:.1f}%"
                if ttft
                else "-"
            ),
            "KV on the TTFT path p50 (ms)": f"{percentile(exposed, 0.5) * 1e3:.2f}",
            "retried / 503 / failed / hung": f"{retried} / {self.unavailable} / {self.failed} / {self.hung}",
            "blocks in use after the run": str(sum(max(0, n) for n in self.leaks.values())),
            "wall time (s)": f"{self.wall:.2f}",
            "requests/s": f"{len(ok) / self.wall:.1f}" if self.wall else "-",
        }
        if self.kill is not None:
            k = self.kill
            rows["prefill-0 killed, blocks in flight"] = str(k.in_flight_blocks)
            rows["restarted prefill-0 served"] = f"{k.served_after_restart} requests"
        return rows


def _bytes(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.1f} KiB"


def render_table(reports: list[ModeReport], args: argparse.Namespace, model: ModelConfig) -> Table:
    title = (
        f"{args.prefill}P{args.decode}D over {args.backend}, {model.name} "
        f"(d={model.d_model}, {model.n_layers} layers, {model.block_size}-token blocks), "
        f"{args.requests} requests x {args.max_tokens} tokens, concurrency {args.concurrency}"
        + (", prefill-0 killed mid-run" if args.kill_prefill else "")
    )
    return table_of(reports, title)


def table_of(reports: list[ModeReport], title: str) -> Table:
    """One column per mode, one row per figure, then the verdict."""
    table = Table(title=title, title_justify="left")
    table.add_column("")
    for r in reports:
        table.add_column(f"{r.mode.upper()} mode", justify="right")
    figures = [r.figures() for r in reports]
    for key in figures[0]:
        table.add_row(key, *(f.get(key, "-") for f in figures))
    table.add_row("verdict", *("[green]PASS[/]" if r.passed else "[red]FAIL[/]" for r in reports))
    return table
