"""Starting and stopping the fleet's processes: each in its own process group, none left behind.

Every child is ``python -m moriio_async.serving <role> --parent-watch ...`` in a
new session (its own process group, so a terminal's Ctrl-C reaches only the
launcher, which then stops the children in order). A child prints one JSON line
with its URL when it serves; its log goes to a file. ``stop`` is SIGTERM to the
group (uvicorn shuts down gracefully, the engine closes), then SIGKILL after a
grace period; ``kill`` is SIGKILL at once (the failure the demo injects);
``restart`` starts the same command on the same port (a new engine incarnation).
With ``--parent-watch`` a child also exits when its stdin closes, so even a
launcher killed by SIGKILL leaves no server behind.

Every child gets the fleet's shared secret in ``$MORIIO_ASYNC_SECRET`` (its
engine's hellos then prove it), or, with none, runs without one even if the
launcher's own environment has one. The environment, not the command line: a
process's arguments are visible to every user of the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "SECRET_ENV",
    "Child",
    "Launcher",
    "StartFailed",
    "cancel_on_signals",
    "group_alive",
    "kill_group",
    "log_tail",
    "signal_group",
    "start_group",
    "stop_group",
]

SECRET_ENV = "MORIIO_ASYNC_SECRET"
"""The variable every ``IOEngine`` reads its shared secret from (serving uses only the public API, which
does not name it)."""


class StartFailed(RuntimeError):
    """A child exited or stayed silent instead of serving."""


@dataclass(eq=False)
class Child:
    role: str
    name: str
    args: list[str]
    log: Path
    port: int = 0
    url: str = ""
    proc: asyncio.subprocess.Process | None = None
    starts: int = field(default=0)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None


class Launcher:
    """Owns the fleet's child processes."""

    def __init__(self, log_dir: Path, secret: str | None, startup_timeout: float = 60.0) -> None:
        self.log_dir, self.startup_timeout = log_dir, startup_timeout
        self.children: list[Child] = []
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            self.env[var] = "1"
        if secret:
            self.env[SECRET_ENV] = secret
        else:
            self.env.pop(SECRET_ENV, None)

    async def spawn(self, role: str, name: str, args: list[str], port: int = 0) -> Child:
        child = Child(role, name, list(args), self.log_dir / f"{name}.log", port)
        self.children.append(child)
        await self._start(child)
        return child

    async def _start(self, child: Child) -> None:
        child.starts += 1
        argv = [sys.executable, "-m", "moriio_async.serving", "--log-level", "INFO", child.role]
        argv += ["--port", str(child.port), "--parent-watch", *child.args]
        if child.role != "proxy":
            argv += ["--name", child.name]
        pipe = asyncio.subprocess.PIPE  # stdin: --parent-watch; stdout: the line with its URL
        child.proc = await start_group(argv, child.log, child.starts, env=self.env, stdin=pipe, stdout=pipe)
        assert child.proc.stdout is not None
        try:
            line = await asyncio.wait_for(child.proc.stdout.readline(), self.startup_timeout)
            info = json.loads(line) if line else None
        except (TimeoutError, ValueError):
            info = None
        if not info:
            signal_group(child.proc, signal.SIGKILL)
            raise StartFailed(f"{child.name} did not start; its log:\n{self.tail(child)}")
        child.url, child.port = info["url"], int(info["url"].rsplit(":", 1)[1])
        with child.log.open("ab") as log:
            log.write(f"== serving at {child.url}, pid {child.proc.pid}\n".encode())

    def tail(self, child: Child, lines: int = 30) -> str:
        return log_tail(child.log, lines)

    async def kill(self, child: Child) -> None:
        """SIGKILL the child's process group now (failure injection) and reap it."""
        await kill_group(child.proc)

    async def restart(self, child: Child) -> None:
        """The same command on the same port: a new process, a new engine incarnation."""
        if child.running:
            await self.stop(child)
        await self._start(child)

    async def stop(self, child: Child, grace: float = 5.0) -> int | None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; returns the exit status (``stop_group``)."""
        code = await stop_group(child.proc, grace)
        if child.proc is not None and child.proc.stdin is not None:
            child.proc.stdin.close()
        return code

    async def close(self) -> dict[str, int | None]:
        """Stop every child (proxies first); their exit statuses by name."""
        order = sorted(self.children, key=lambda c: c.role != "proxy")
        statuses: dict[str, int | None] = {}
        for group in ([c for c in order if c.role == "proxy"], [c for c in order if c.role != "proxy"]):
            codes = await asyncio.gather(*(self.stop(c) for c in group))
            statuses.update({c.name: code for c, code in zip(group, codes, strict=True)})
        return statuses


def log_tail(log: Path, lines: int) -> str:
    """The last ``lines`` lines of a child's log, for an error message ("(no log)" if it cannot be read)."""
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


async def start_group(
    argv: list[str],
    log: Path,
    start: int,
    *,
    env: Mapping[str, str],
    stdin: int,
    stdout: int | None = None,
    preexec_fn: Callable[[], object] | None = None,
) -> asyncio.subprocess.Process:
    """``argv`` as the leader of a new process group (``signal_group``, ``stop_group``), its stderr, and its
    stdout unless ``stdout`` says otherwise, appended to ``log`` after a line saying it is start ``start``."""
    with log.open("ab") as out:
        out.write(f"== start {start}: {' '.join(argv)}\n".encode())
        out.flush()
        return await asyncio.create_subprocess_exec(
            *argv,
            stdin=stdin,
            stdout=out if stdout is None else stdout,
            stderr=out,
            env=env,
            start_new_session=True,
            preexec_fn=preexec_fn,
        )


def signal_group(proc: asyncio.subprocess.Process | None, sig: signal.Signals) -> None:
    """Send ``sig`` to the process group ``proc`` leads (started with ``start_new_session``), if it still runs."""
    if proc is None or proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


async def kill_group(proc: asyncio.subprocess.Process | None) -> None:
    """SIGKILL ``proc``'s process group now (failure injection) and reap ``proc``."""
    signal_group(proc, signal.SIGKILL)
    if proc is not None:
        await proc.wait()


async def stop_group(proc: asyncio.subprocess.Process | None, grace: float) -> int | None:
    """SIGCONT (a stopped process cannot handle SIGTERM) and SIGTERM to ``proc``'s process group, SIGKILL
    after ``grace`` seconds; then SIGKILL whatever of the group is left (stragglers: an engine core, workers).
    ``proc``'s exit status (None: it never started)."""
    if proc is None:
        return None
    if proc.returncode is None:
        signal_group(proc, signal.SIGCONT)
        signal_group(proc, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), grace)
        except TimeoutError:
            signal_group(proc, signal.SIGKILL)
            await proc.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode


def group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies waiting to be reaped by init do not count)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def cancel_on_signals() -> None:
    """Ctrl-C and SIGTERM cancel the running task, so its ``finally`` stops every process it started."""
    main = asyncio.current_task()
    assert main is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, main.cancel)
