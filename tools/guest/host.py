"""The host side of the guest build: commands, logging, and the Debian packages it needs.

Used by ``build.py`` (which installs what is missing when run as root) and by
``run.py --check`` (which only reports it). Standard library only.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

# Debian packages the harness needs on the host (checked with dpkg first).
APT_PACKAGES: tuple[str, ...] = (
    "qemu-system-x86",  # the emulator (software TCG; nested KVM hangs here)
    "busybox-static",  # the initramfs userland
    "cpio",  # packs the initramfs
    "kmod",  # depmod for the unpacked kernel; modprobe in the guest
    "iproute2",  # ip (veth pairs) and rdma (rxe links) inside the guest
    "libnl-3-dev",  # rdma-core 59 build
    "libnl-route-3-dev",
    "pkg-config",
    "cmake",
    "ninja-build",
    "gcc",
    "perftest",  # ib_write_bw & co. for cross-checks inside the guest
    "ibverbs-providers",
)


def log(msg: str) -> None:
    print(f"[guest-build] {msg}", file=sys.stderr, flush=True)


class BuildError(RuntimeError):
    """A step of the build failed; the message says which and why."""


def run(
    cmd: Sequence[str], *, cwd: Path | None = None, env: dict[str, str] | None = None, log_file: Path | None = None
) -> None:
    """Run a command; on failure raise BuildError with the tail of its output."""
    printable = " ".join(shlex.quote(c) for c in cmd)
    log(f"$ {printable}")
    if log_file is None:
        captured = subprocess.run(
            cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False
        )
        output, returncode = captured.stdout + captured.stderr, captured.returncode
    else:
        with log_file.open("w") as fh:
            returncode = subprocess.run(
                cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT, check=False
            ).returncode
        output = log_file.read_text(errors="replace")
    if returncode != 0:
        tail = "\n".join(output.splitlines()[-40:])
        where = f" (full log: {log_file})" if log_file else ""
        raise BuildError(f"command failed with exit {returncode}: {printable}{where}\n{tail}")


def capture(cmd: Sequence[str]) -> str:
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False)
    return proc.stdout if proc.returncode == 0 else ""


def is_root() -> bool:
    return os.geteuid() == 0


# --------------------------------------------------------------------------- apt

_apt_updated = False


def apt_update() -> None:
    global _apt_updated
    if not _apt_updated:
        run(["apt-get", "update", "-q"])
        _apt_updated = True


def missing_packages(packages: Sequence[str] = APT_PACKAGES) -> list[str]:
    out = capture(["dpkg-query", "-W", "-f=${Package} ${Status}\n", *packages])
    installed = {line.split()[0] for line in out.splitlines() if line.endswith("install ok installed")}
    return [p for p in packages if p not in installed]


def ensure_packages() -> float:
    """Install the Debian packages that are missing; returns seconds spent."""
    missing = missing_packages()
    if not missing:
        log("debian packages: all present")
        return 0.0
    if not is_root():
        raise BuildError(f"missing Debian packages {missing}; run as root or apt-get install {' '.join(missing)}")
    start = time.monotonic()
    log(f"debian packages: installing {' '.join(missing)}")
    apt_update()
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing], env=env)
    return time.monotonic() - start


def kernel_package() -> str:
    """The linux-image-<kver> package that linux-image-amd64 depends on now."""
    override = os.environ.get("MORIIO_GUEST_KERNEL_PKG")
    if override:
        return override
    for attempt in range(2):
        out = capture(["apt-cache", "depends", "linux-image-amd64"])
        for line in out.splitlines():
            word = line.strip().removeprefix("Depends:").strip()
            if line.strip().startswith("Depends:") and word.startswith("linux-image-"):
                return word
        if attempt == 0 and is_root():
            apt_update()
    raise BuildError(
        "apt-cache names no kernel for linux-image-amd64 (run apt-get update as root, or set MORIIO_GUEST_KERNEL_PKG)"
    )
