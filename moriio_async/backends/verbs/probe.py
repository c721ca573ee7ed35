"""``probe()``: device facts for ``doctor``, gathered without opening a backend."""

from __future__ import annotations

import os

from ...errors import BackendUnavailable, MoriioError
from .facts import DeviceFacts, PortFacts, ProbeReport

__all__ = ["run_probe"]


def _netdevs(device: str) -> tuple[str, ...]:
    base = f"/sys/class/infiniband/{device}/ports"
    found: set[str] = set()
    try:
        for port in os.listdir(base):
            ndevs = f"{base}/{port}/gid_attrs/ndevs"
            for index in os.listdir(ndevs):
                try:
                    with open(f"{ndevs}/{index}") as f:
                        found.add(f.read().strip())
                except OSError:
                    continue
    except OSError:
        pass
    return tuple(sorted(n for n in found if n))


def run_probe(port: int | None) -> ProbeReport:
    try:
        from . import _pyverbs as pv
    except BackendUnavailable as exc:
        return ProbeReport(pyverbs_version=None, has_channel_fd=False, error=str(exc.args[0]), hint=exc.hint)
    try:
        names = pv.list_devices()
    except BackendUnavailable as exc:
        return ProbeReport(
            pyverbs_version=pv.PYVERBS_VERSION,
            has_channel_fd=pv.has_channel_fd(),
            error=str(exc.args[0]),
            hint=exc.hint,
        )
    devices = []
    for name in names:
        try:
            ctx = pv.Context(name)
        except MoriioError as exc:
            devices.append(DeviceFacts(name=name, error=str(exc)))
            continue
        try:
            limits = ctx.limits()
            wanted = [port] if port is not None else list(range(1, limits.phys_port_cnt + 1))
            ports: list[PortFacts] = [ctx.port(p) for p in wanted]
            devices.append(DeviceFacts(name=name, limits=limits, ports=tuple(ports), netdevs=_netdevs(name)))
        except MoriioError as exc:
            devices.append(DeviceFacts(name=name, error=str(exc)))
        finally:
            ctx.close()
    return ProbeReport(pyverbs_version=pv.PYVERBS_VERSION, has_channel_fd=pv.has_channel_fd(), devices=tuple(devices))
