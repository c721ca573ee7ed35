"""The demo's ``--engine vllm`` options (kept apart so the numpy demo's parser imports nothing else of it)."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_vllm_args"]


def add_vllm_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--engine vllm")
    g.add_argument("--model-dir", type=Path, default=None, help="where the tiny model is made (default: a cache)")
    g.add_argument(
        "--stop-prefill", action="store_true", help="SIGSTOP the prefill server mid-run for longer than the timeout"
    )
    g.add_argument("--startup-timeout", type=float, default=400.0, help="seconds a vLLM server may take to start")
