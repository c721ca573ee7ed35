"""Run ``wr_cost.py`` against several checkouts, alternating, and print medians per row and tree.

    git worktree add /tmp/before <commit>
    python benchmarks/side_by_side.py --trees /tmp/before . --rounds 5 -- --backends mock --sizes 4K --blocks 1 1024

Each round runs this checkout's ``wr_cost.py`` once per tree, in turn, with
``PYTHONPATH`` set to that tree (so the same measuring code times each
implementation), and the load average before each run is kept. On a shared
machine, CPU per work request is steadier than wall time: both are reported,
as medians over the rounds (and the lowest CPU figure, the least disturbed).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="+", required=True, help="checkouts to import moriio_async from")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("wr_cost_args", nargs=argparse.REMAINDER, help="after --: arguments for wr_cost.py")
    args = ap.parse_args(argv)
    extra = [a for a in args.wr_cost_args if a != "--"]
    trees = [str(Path(t).resolve()) for t in args.trees]
    rows: dict[tuple[str, str], list[dict[str, float]]] = collections.defaultdict(list)
    loads: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for i, tree in enumerate(trees):
                out = os.path.join(tmp, f"{r}-{i}.json")
                loads.append(os.getloadavg()[0])
                env = {**os.environ, "PYTHONPATH": tree}
                subprocess.run([sys.executable, str(HERE / "wr_cost.py"), *extra, "--json", out], env=env, check=True,
                               stdout=subprocess.DEVNULL)  # fmt: skip
                with open(out) as f:
                    got = json.load(f)
                for row in got:
                    key = f"{row['backend']} {row['procs']}p {row['op']} {row['size'] >> 10}K x{row['blocks']}"
                    rows[(key, tree)].append(row)
    span = f"{min(loads):.1f}-{max(loads):.1f} (median {statistics.median(loads):.1f})"
    print(f"{args.rounds} rounds, load average {span}")
    print(f"{'row':48} {'tree':28} {'cpu us/wr med (min)':>20} {'wall us/wr med':>15} {'k wr/s med':>11}")
    for key in dict.fromkeys(k for k, _ in rows):
        for tree in trees:
            got = rows[(key, tree)]
            cpu = [g["cpu_us_per_wr"] for g in got]
            wall = [g["wall_us_per_wr"] for g in got]
            rate = [g["ops_per_s"] / 1e3 for g in got]
            print(f"{key:48} {Path(tree).name:28} {statistics.median(cpu):11.2f} ({min(cpu):6.2f})"
                  f" {statistics.median(wall):15.2f} {statistics.median(rate):11.1f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
