#!/usr/bin/env python3
"""Run a command inside one or two Soft-RoCE QEMU guests; exit with its code.

Usage::

    python3 tools/guest/run.py [--guests 1|2] [--timeout S] [--mem MB] -- CMD ARGS...
    python3 tools/guest/run.py --check

The guest boots Debian's kernel (software emulation, no KVM), loads rdma_rxe,
mounts the host's root read-only over 9p and chroots into it, so CMD runs with
the host's Python, this repository and the cached pyverbs build, in the host's
current directory. A results directory (``--out``, default a new directory
under /tmp) is shared writable at the same absolute path; CMD finds it in
``MORIIO_GUEST_OUT``.

One guest: no network device at all; a veth pair inside the guest carries
``rxe0``. Two guests (roles ``a`` and ``b``): each gets one virtio NIC on a QEMU
UDP socket over the host's loopback, wired only to the other guest, with
10.77.0.1 (a) and 10.77.0.2 (b) and ``rxe0`` on it; CMD runs in both, and the
run fails if either fails.

Exit codes: CMD's own (the first nonzero one with two guests); 124 on
--timeout; 125 when the harness itself failed (build error, a guest that
stopped without reporting); 3 from --check when the harness cannot run here.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build
from host import BuildError, missing_packages
from jobs import ONE_GUEST_NET, TWO_GUEST_NET, Guest, free_udp_port, qemu_command, write_job
from layout import STAGE2_SCRIPT, cache_root

EXIT_TIMEOUT = 124
EXIT_HARNESS = 125
EXIT_CANNOT_RUN = 3

# After one guest fails, how long the other may go on before it is stopped.
PEER_GRACE_SECONDS = 30.0

_ANSI = re.compile(r"\x1b(\[[0-9;?]*[A-Za-z]|[()][A-Za-z0-9]|[A-Za-z=>])")
_print_lock = threading.Lock()


def say(msg: str) -> None:
    with _print_lock:
        print(f"[guest-run] {msg}", flush=True)


# --------------------------------------------------------------------------- check


def why_cannot_run() -> str | None:
    """None if the harness can run on this host, else one line saying why and how."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return f"the Soft-RoCE guest needs an x86_64 Linux host (this is {sys.platform}/{platform.machine()})"
    root = os.geteuid() == 0
    missing = missing_packages() if shutil.which("dpkg-query") else ["dpkg"]
    if missing and not (root and shutil.which("apt-get")):
        return (
            f"missing Debian packages ({' '.join(missing)}) and no root to install them: "
            f"run as root, or apt-get install {' '.join(missing)}"
        )
    cache = cache_root()
    probe = cache
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not os.access(probe, os.W_OK):
        return f"cache {cache} is not writable: run as root or set MORIIO_GUEST_CACHE to a writable directory"
    return None


# --------------------------------------------------------------------------- running


def stream(guest: Guest, log_path: Path, t0: float) -> None:
    assert guest.proc is not None
    assert guest.proc.stdout is not None
    with log_path.open("wb") as log:
        for raw in guest.proc.stdout:
            log.write(raw)
            log.flush()
            line = _ANSI.sub("", raw.decode("utf-8", "replace")).replace("\r", "").rstrip("\n")
            if "moriio-guest: ready" in line and guest.ready_at is None:
                guest.ready_at = time.monotonic() - t0
            with _print_lock:
                print(f"[guest {guest.role}] {line}", flush=True)


def _die_with_parent() -> None:
    """In the qemu child: get SIGKILL if run.py dies, even by SIGKILL (PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def _terminate(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def stop(guest: Guest) -> None:
    if guest.proc is not None and guest.proc.poll() is None:
        guest.proc.kill()
        guest.proc.wait()


def run_guests(args: argparse.Namespace, cmd: Sequence[str]) -> int:
    t0 = time.monotonic()
    try:
        lay = build.ensure_built()
    except BuildError as exc:
        say(f"FAILED to build the guest: {exc}")
        return EXIT_HARNESS
    build_s = time.monotonic() - t0

    out = Path(args.out).resolve() if args.out else Path(tempfile.mkdtemp(prefix="moriio-guest-", dir="/tmp"))
    out.mkdir(parents=True, exist_ok=True)
    for p in (out, STAGE2_SCRIPT, Path.cwd()):
        if re.search(r"\s", str(p)):
            say(f"paths with whitespace are not supported: {p!r}")
            return EXIT_HARNESS
    state = out / ".moriio-guest"
    state.mkdir(exist_ok=True)
    for stale in state.glob("exit-*"):
        stale.unlink()

    count = args.guests
    if count == 1:
        guests = [Guest("a", ONE_GUEST_NET[0], ONE_GUEST_NET[0], "veth", ["-nic", "none"])]
    else:
        port_a, port_b = free_udp_port(), free_udp_port()
        while port_b == port_a:
            port_b = free_udp_port()
        guests = []
        for i, (role, mine, theirs) in enumerate((("a", port_a, port_b), ("b", port_b, port_a))):
            wire = [
                "-netdev",
                f"socket,id=wire,udp=127.0.0.1:{theirs},localaddr=127.0.0.1:{mine}",
                # romfile= : no iPXE option ROM (we boot with -kernel).
                "-device",
                f"virtio-net-pci,netdev=wire,mac=52:54:00:4d:49:0{i + 1},romfile=",
            ]
            guests.append(Guest(role, TWO_GUEST_NET[i], TWO_GUEST_NET[1 - i], "eth", wire))
    smp = args.smp or (2 if count == 1 else 1)

    for g in guests:
        write_job(state, lay, g, out, count, cmd)
    say(f"cache {lay.root}")
    say(f"results {out}")
    say(
        f"{count} guest(s), {smp} vCPU and {args.mem} MiB each, timeout {args.timeout:.0f}s: "
        f"{' '.join(shlex.quote(c) for c in cmd)}"
    )

    boot_t0 = time.monotonic()
    signal.signal(signal.SIGTERM, _terminate)  # a killed run must not leave qemu running
    try:
        for g in guests:
            argv = qemu_command(lay, g, out, count, mem=args.mem, smp=smp, verbose=args.verbose)
            (state / f"qemu-{g.role}.cmd").write_text(shlex.join(argv) + "\n")
            g.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
            g.reader = threading.Thread(target=stream, args=(g, state / f"console-{g.role}.log", boot_t0), daemon=True)
            g.reader.start()
        timed_out = wait_all(guests, boot_t0 + args.timeout, state)
    except KeyboardInterrupt:
        say("interrupted (Ctrl-C or SIGTERM): stopping the guest(s)")
        timed_out = False
        for g in guests:
            stop(g)
        return 130
    finally:
        for g in guests:
            stop(g)
            if g.reader is not None:
                g.reader.join(timeout=5)

    total = time.monotonic() - t0
    for g in guests:
        boot = f"{g.ready_at:.1f}s" if g.ready_at is not None else "never"
        say(f"guest {g.role}: booted to ready in {boot}, exit code {g.exit_code}")
    say(
        f"wall clock: build/cache check {build_s:.1f}s, guests {time.monotonic() - boot_t0:.1f}s,"
        f" whole run {total:.1f}s"
    )
    if timed_out:
        say(
            f"TIMEOUT: the guest(s) did not finish within --timeout {args.timeout:.0f}s; "
            f"qemu was killed (console logs in {state})"
        )
        return EXIT_TIMEOUT
    codes = [g.exit_code if g.exit_code is not None else EXIT_HARNESS for g in guests]
    for g in guests:
        if g.exit_code is None:
            say(
                f"guest {g.role} stopped without reporting an exit code (see its console "
                f"above or {state}/console-{g.role}.log)"
            )
    return next((c for c in codes if c != 0), 0)


def read_exit(state: Path, role: str) -> int | None:
    try:
        return int((state / f"exit-{role}").read_text().strip())
    except (OSError, ValueError):
        return None


def wait_all(guests: list[Guest], deadline: float, state: Path) -> bool:
    """Wait for every qemu to end; returns True if the deadline passed first."""
    grace_deadline: float | None = None
    while True:
        now = time.monotonic()
        running = [g for g in guests if g.proc is not None and g.proc.poll() is None]
        for g in guests:
            if g.ended_at is None and g not in running:
                g.ended_at = now
                g.exit_code = read_exit(state, g.role)
                if g.exit_code != 0 and grace_deadline is None and len(guests) > 1:
                    grace_deadline = now + PEER_GRACE_SECONDS
        if not running:
            return False
        if now > deadline:
            for g in running:
                stop(g)
            return True
        if grace_deadline is not None and now > grace_deadline:
            for g in running:
                say(f"guest {g.role}: stopping it, its peer failed {PEER_GRACE_SECONDS:.0f}s ago")
                stop(g)
        time.sleep(0.2)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd: list[str] = []
    if "--" in argv:
        cmd = argv[argv.index("--") + 1 :]
        argv = argv[: argv.index("--")]
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        usage="%(prog)s [--guests 1|2] [--timeout S] [--mem MB] [--out DIR] -- CMD ARGS...",
    )
    parser.add_argument("--guests", type=int, choices=(1, 2), default=1)
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds for the whole run after the build (default 600)"
    )
    parser.add_argument("--mem", type=int, default=2048, help="MiB per guest (default 2048)")
    parser.add_argument("--smp", type=int, default=0, help="vCPUs per guest (default: 2 for one guest, 1 each for two)")
    parser.add_argument("--out", help="results directory shared writable with the guest(s)")
    parser.add_argument("--verbose", action="store_true", help="show all kernel messages")
    parser.add_argument(
        "--check", action="store_true", help="exit 0 if the harness can run here, else say why and exit 3"
    )
    args = parser.parse_args(argv)

    if args.check:
        reason = why_cannot_run()
        if reason:
            print(f"moriio guest harness unavailable: {reason}")
            return EXIT_CANNOT_RUN
        return 0
    if not cmd:
        parser.error("no command: put it after --")
    reason = why_cannot_run()
    if reason:
        say(f"cannot run: {reason}")
        return EXIT_CANNOT_RUN
    return run_guests(args, cmd)


if __name__ == "__main__":
    sys.exit(main())
