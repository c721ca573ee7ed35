"""Test hosts made of network namespaces: several "machines" on one bridge, reached by address.

Each host is a network namespace with one veth (``eth0``) on a bridge that
lives in a namespace of its own; the root namespace gets a veth on the same
bridge too, so a process here (the proxy, the test's client) reaches every
host by its address. Nothing is routed or forwarded: one private /24 segment
inside this machine, torn down on exit. Needs root and iproute2's ``ip``.

Processes started in a host (``Hosts.popen``) share this machine's kernel but
not its network stack: their engines see another net namespace, so a
same-host transport (cma, whose scope includes the net namespace) is not
chosen between them, exactly as between two machines.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from typing import Any

__all__ = ["Hosts", "hosts_unavailable"]


def hosts_unavailable() -> str:
    """Why test hosts cannot be made here ("" when they can)."""
    if os.geteuid() != 0:
        return "network-namespace hosts need root (ip netns)"
    if shutil.which("ip") is None:
        return "network-namespace hosts need iproute2's ip (apt-get install iproute2)"
    probe = f"mio{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if made.returncode:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return ""


class Hosts:
    """``n`` hosts at ``address(0..n-1)``; the root namespace at ``here``."""

    def __init__(self, n: int) -> None:
        tag = f"mio{os.getpid() % 1_000_000}"
        self.n = n
        self.bridge_ns = f"{tag}-br"
        self.names = [f"{tag}-h{i}" for i in range(n)]
        self.root_if = f"{tag}r"
        subnet = os.getpid() % 200 + 20
        self.prefix = f"10.77.{subnet}"
        self.here = f"{self.prefix}.1"

    def address(self, i: int) -> str:
        return f"{self.prefix}.{i + 2}"

    def __enter__(self) -> Hosts:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make(self) -> None:
        br = self.bridge_ns
        _ip("netns", "add", br)
        _ip("-n", br, "link", "add", "br0", "type", "bridge")
        _ip("-n", br, "link", "set", "br0", "up")
        for i, ns in enumerate(self.names):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "add", f"{self.root_if}{i}", "type", "veth", "peer", "name", f"h{i}", "netns", br)
            _ip("link", "set", f"{self.root_if}{i}", "netns", ns)
            _ip("-n", ns, "link", "set", f"{self.root_if}{i}", "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", br, "link", "set", f"h{i}", "master", "br0")
            _ip("-n", br, "link", "set", f"h{i}", "up")
        _ip("link", "add", self.root_if, "type", "veth", "peer", "name", "root", "netns", br)
        _ip("-n", br, "link", "set", "root", "master", "br0")
        _ip("-n", br, "link", "set", "root", "up")
        _ip("addr", "add", f"{self.here}/24", "dev", self.root_if)
        _ip("link", "set", self.root_if, "up")

    def close(self) -> None:
        """Remove every namespace and link this made (deleting a namespace deletes its veths)."""
        subprocess.run(["ip", "link", "del", self.root_if], capture_output=True, check=False)
        for ns in [*self.names, self.bridge_ns]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)

    def popen(self, i: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[str]:
        """Start ``argv`` on host ``i`` (``ip netns exec`` execs it: the pid is the program's)."""
        return subprocess.Popen(["ip", "netns", "exec", self.names[i], *argv], text=True, **kwargs)


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
