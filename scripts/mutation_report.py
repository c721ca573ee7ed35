"""Score per module of the mutation run kept in mutants/ (scripts/mutation writes it).

A mutant counts as killed when a test failed on it or it hung into its timeout (the suite would not
pass either way). Survivors are listed by name (``python3 -m mutmut show NAME`` prints the diff);
``no tests`` means no test in the selection calls the mutated function at all, so it counts against
the score too. Mutants judged equivalent (no behaviour could tell them from the original) are listed
with the reason in tests/mutation-equivalent.txt, one ``NAME  # reason`` a line, and leave the
denominator. Arguments (module paths) narrow the report to those modules.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

GOAL = 0.90
TIMEOUT = (36, 24, -24, 152, 255)
"""mutmut's exit codes for a mutant stopped at its time limit (SIGXCPU)."""
KILLED: dict[int | None, str] = {1: "killed", 3: "killed", **dict.fromkeys(TIMEOUT, "timeout")}
OTHER: dict[int | None, str] = {0: "survived", 5: "no tests", 33: "no tests", 34: "skipped", None: "not checked"}


def equivalents(path: Path) -> dict[str, str]:
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            name, _, reason = line.partition("#")
            if name.strip():
                out[name.strip()] = reason.strip()
    return out


def main(modules: list[str]) -> int:
    metas = sorted(Path("mutants").glob("moriio_async/**/*.py.meta"))
    if not metas:
        print("no mutation results under mutants/: run scripts/mutation first")
        return 1
    wanted = {m.removesuffix(".py") for m in modules}
    equivalent = equivalents(Path("tests/mutation-equivalent.txt"))
    rows = []
    survivors: list[tuple[str, str, int | None]] = []
    for meta in metas:
        module = str(meta.relative_to("mutants")).removesuffix(".py.meta")
        if wanted and module not in wanted:
            continue
        codes: dict[str, int | None] = json.loads(meta.read_text())["exit_code_by_key"]
        if not codes:
            continue
        status: Counter[str] = Counter()
        for name, code in codes.items():
            kind = "equivalent" if name in equivalent else KILLED.get(code) or OTHER.get(code, "suspicious")
            status[kind] += 1
            if kind in ("survived", "no tests", "suspicious"):
                survivors.append((name, kind, code))
        checked = sum(n for kind, n in status.items() if kind not in ("not checked", "equivalent", "skipped"))
        killed = status["killed"] + status["timeout"]
        rows.append((module, len(codes), status, killed, checked))
    if not rows:
        print("no results for", ", ".join(modules))
        return 1
    print(
        f"{'module':45} {'mutants':>7} {'killed':>6} {'timeout':>7} {'survived':>8} {'no tests':>8} {'equiv':>5} "
        f"{'unrun':>5} {'score':>6}"
    )
    total_killed = total_checked = 0
    for module, n, status, killed, checked in rows:
        score = f"{killed / checked:6.1%}" if checked else "     -"
        print(
            f"{module:45} {n:7} {status['killed']:6} {status['timeout']:7} {status['survived']:8} "
            f"{status['no tests']:8} {status['equivalent']:5} {status['not checked']:5} {score}"
        )
        total_killed += killed
        total_checked += checked
    if total_checked:
        overall = total_killed / total_checked
        verdict = "meets" if overall >= GOAL else "is below"
        print(
            f"\nkilled {total_killed} of {total_checked} non-equivalent mutants run: {overall:.1%} "
            f"({verdict} the {GOAL:.0%} goal)"
        )
    if survivors:
        print("\nnot killed (python3 -m mutmut show NAME for the diff):")
        for name, kind, code in survivors:
            exit_code = f" (exit code {code})" if kind == "suspicious" else ""
            print(f"  {kind:10} {name}{exit_code}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
