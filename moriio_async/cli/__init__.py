"""The ``moriio-async`` command: one subcommand per module of this package."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["main"]

# name -> (module, one-line help); each module has add_arguments(parser) and run(args) -> int.
SUBCOMMANDS = {
    "doctor": ("moriio_async.cli.doctor", "check this node: pyverbs, RDMA devices, GIDs, memlock, TCP"),
    "faults": ("moriio_async.cli.faults", "run a fault plan between two processes on loopback (tcp or verbs backend)"),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moriio-async", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    code: int = module.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
