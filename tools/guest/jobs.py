"""What one guest runs with: its roles and addresses, the job file its stage 2 sources, the QEMU command.

``run.py`` boots the guests from these; the network constants here are the
ones ``stage2.sh`` receives through the job file. Standard library only.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from layout import STAGE2_SCRIPT, Layout, guest_env

QEMU = "qemu-system-x86_64"
RDMA_DEVICE = "rxe0"
# One guest: veth0 (carries rxe0) and its veth1 end. Both QPs of a test live on
# rxe0, so the peer's address IS this guest's own: SELF_IP == PEER_IP there.
ONE_GUEST_NET = ("10.77.1.1", "10.77.1.2")
TWO_GUEST_NET = ("10.77.0.1", "10.77.0.2")  # eth0 of guest a and of guest b
PREFIX_LEN = 24


@dataclass
class Guest:
    role: str
    self_ip: str
    peer_ip: str
    net_mode: str
    qemu_args: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    reader: threading.Thread | None = None
    ready_at: float | None = None
    ended_at: float | None = None
    exit_code: int | None = None


def guest_environment(lay: Layout, guest: Guest, out: Path, count: int) -> dict[str, str]:
    """The complete environment CMD gets inside the guest (nothing else leaks in)."""
    pydir = str(Path(sys.executable).parent)
    env: dict[str, str] = {
        "PATH": f"{pydir}:{lay.prefix}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "LANG": "C.UTF-8",
        "TERM": "dumb",
    }
    for name, value in os.environ.items():
        if name.startswith("MORIIO_") or name == "PYTEST_ADDOPTS":
            env[name] = value
    env.update(guest_env(lay))
    env.update(
        {
            "HOME": "/tmp",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
            "MORIIO_GUEST": "1",
            "MORIIO_GUEST_OUT": str(out),
            "MORIIO_GUEST_ROLE": guest.role,
            "MORIIO_GUEST_COUNT": str(count),
            "MORIIO_GUEST_DEVICE": RDMA_DEVICE,
            "MORIIO_GUEST_SELF_IP": guest.self_ip,
            "MORIIO_GUEST_PEER_IP": guest.peer_ip,
            "MORIIO_GUEST_KERNEL_ROOT": str(lay.kernel_dir),
        }
    )
    return env


def write_job(state: Path, lay: Layout, guest: Guest, out: Path, count: int, cmd: Sequence[str]) -> None:
    env = guest_environment(lay, guest, out, count)
    q = shlex.quote
    assignments = " ".join(q(f"{k}={v}") for k, v in sorted(env.items()))
    lines = [
        "# Written by tools/guest/run.py; sourced by stage2.sh inside the guest.",
        f"net_mode={q(guest.net_mode)}",
        f"self_ip={q(guest.self_ip)}",
        f"peer_ip={q(guest.peer_ip)}",
        f"veth1_ip={q(ONE_GUEST_NET[1])}",
        f"prefix_len={PREFIX_LEN}",
        f"rdma_dev={q(RDMA_DEVICE)}",
        f"rdma_core_prefix={q(str(lay.prefix))}",
        f"kernel_root={q(str(lay.kernel_dir))}",
        f"job_cwd={q(os.getcwd())}",
        "run_job() {",
        f"    env -i {assignments} {' '.join(q(c) for c in cmd)}",
        "}",
        "",
    ]
    (state / f"job-{guest.role}.sh").write_text("\n".join(lines))


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def qemu_command(lay: Layout, guest: Guest, out: Path, count: int, *, mem: int, smp: int, verbose: bool) -> list[str]:
    stage2 = STAGE2_SCRIPT
    append = [
        "console=ttyS0",
        "panic=-1",
        *([] if verbose else ["quiet", "loglevel=4"]),
        f"moriio_stage2={stage2}",
        f"moriio_out={out}",
        f"moriio_role={guest.role}",
        f"moriio_guests={count}",
    ]
    return [
        QEMU,
        "-name",
        f"moriio-guest-{guest.role}",
        # -enable-kvm hangs on these (nested) machines: software emulation.
        "-machine",
        "pc",
        "-accel",
        "tcg",
        "-cpu",
        "max",
        "-smp",
        str(smp),
        "-m",
        str(mem),
        "-nodefaults",
        "-no-user-config",
        "-nographic",
        "-no-reboot",
        "-serial",
        "stdio",
        "-monitor",
        "none",
        "-kernel",
        str(lay.vmlinuz),
        "-initrd",
        str(lay.initramfs),
        "-append",
        " ".join(append),
        "-virtfs",
        "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
        "-virtfs",
        f"local,path={out},mount_tag=results,security_model=none,multidevs=remap",
        *guest.qemu_args,
    ]
