"""``moriio-async doctor``: can this node move KV cache, and if not, what to do.

Each check prints one line (``ok``, ``warn`` or ``FAIL``) and, when something
is wrong, one ``fix:`` line. The exit status is 0 when the chosen backend
(``--backend verbs|tcp|cma|auto``) can work, 1 when it cannot. The same-host
checks (what cross-memory attach needs: ``doctor_cma.py``) always run.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import select
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..backends import open_backend
from ..backends.base import Backend, BackendOptions, MemoryRegion, QueuePair
from ..backends.options import VerbsOptions
from ..backends.verbs import probe
from ..backends.verbs.facts import GID_TYPE_ROCE_V2, LINK_LAYER_ETHERNET, ProbeReport, memlock_limit
from ..backends.verbs.gid import choose_gid
from ..errors import MoriioError
from ..status import Access, Opcode
from ..work import Sge, WorkCompletion, WorkRequest
from .doctor_cma import check_cma

__all__ = ["add_arguments", "loopback_write", "run"]

_MEMLOCK_MIN = 64 << 20  # below this, registering a few layers of KV cache fails
_LOOPBACK_BYTES = 4096


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend", choices=("verbs", "tcp", "cma", "auto"), default="auto",
        help="the backend that must work for exit status 0 (auto: verbs or tcp; cma: same-host peers)",
    )  # fmt: skip
    parser.add_argument("--device", default=None, help="RDMA device to check (default: every device)")
    parser.add_argument("--port", type=int, default=1, help="RDMA port number (default 1)")
    parser.add_argument("--host", default="127.0.0.1", help="address the TCP loopback check listens on")
    parser.add_argument("--no-loopback", action="store_true", help="skip the loopback write checks")


@dataclass
class _Report:
    out: Callable[[str], None]
    problems: int = 0
    lenient: bool = False
    """Failures of a backend nobody asked for print as warnings."""

    def ok(self, text: str) -> None:
        self.out(f"  ok    {text}")

    def warn(self, text: str, fix: str | None = None) -> None:
        self.out(f"  warn  {text}")
        if fix:
            self.out(f"        fix: {fix}")

    def fail(self, text: str, fix: str | None = None) -> None:
        if self.lenient:
            self.warn(text, fix)
            return
        self.problems += 1
        self.out(f"  FAIL  {text}")
        if fix:
            self.out(f"        fix: {fix}")


def _wait_completion(cq_poll: Callable[[], list[WorkCompletion]], fd: int, timeout: float) -> WorkCompletion | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        wcs = cq_poll()
        if wcs:
            return wcs[0]
        if fd >= 0:
            select.select([fd], [], [], 0.05)
        else:
            time.sleep(0.001)
    return None


def loopback_write(backend: Backend, size: int = _LOOPBACK_BYTES, timeout: float = 10.0) -> float:
    """One RDMA WRITE between two connected pairs of ``backend``, data checked; seconds it took."""
    src = bytearray((i * 7 + 3) & 0xFF for i in range(size))
    dst = bytearray(size)
    regions: list[MemoryRegion] = []
    qps: list[QueuePair] = []
    cq = backend.create_cq(64)
    try:
        r_src = backend.register_memory(memoryview(src), Access.all())
        regions.append(r_src)
        r_dst = backend.register_memory(memoryview(dst), Access.all())
        backend.export_memory(r_dst)
        regions.append(r_dst)
        active, passive = backend.create_qp(cq), backend.create_qp(cq)
        qps += [active, passive]
        errors: list[BaseException] = []

        def passive_side() -> None:
            try:
                passive.connect(active.endpoint())
            except BaseException as exc:
                errors.append(exc)

        helper = threading.Thread(target=passive_side, daemon=True)
        helper.start()
        helper.join(timeout)
        active.connect(passive.endpoint())
        if errors:
            raise errors[0]
        started = time.monotonic()
        cq.req_notify()
        request = WorkRequest(1, Opcode.RDMA_WRITE, (Sge(r_src.addr, size, r_src.lkey),), r_dst.addr, r_dst.rkey)
        active.post_send([request])

        def poll() -> list[WorkCompletion]:
            if cq.fileno() >= 0:
                cq.get_event()
                cq.req_notify()
            return cq.poll(4)

        wc = _wait_completion(poll, cq.fileno(), timeout)
        took = time.monotonic() - started
        if wc is None:
            raise MoriioError(f"no completion within {timeout:g}s")
        if not wc.ok:
            raise MoriioError(f"the write completed with {wc.status.name} (vendor_err {wc.vendor_err})")
        if dst != src:
            raise MoriioError("the write completed but the target bytes differ")
        return took
    finally:
        for qp in qps:
            qp.close()
        cq.close()
        for region in regions:
            backend.deregister_memory(region)


def _check_verbs(report: _Report, facts: ProbeReport, args: argparse.Namespace) -> bool:
    """Print the verbs facts; True when some device has an ACTIVE port with a usable GID."""
    if facts.pyverbs_version is None:
        report.fail(f"pyverbs: {facts.error}", facts.hint)
        return False
    fd_text = "yes" if facts.has_channel_fd else "no (rdma-core < 57: the runtime polls instead of sleeping)"
    report.ok(f"pyverbs {facts.pyverbs_version}, CompChannel.fd: {fd_text}")
    if not facts.has_channel_fd:
        report.warn("completion channel has no fd", "upgrade rdma-core and pyverbs to 57 or later")
    if facts.error is not None:
        report.fail(f"RDMA devices: {facts.error}", facts.hint)
        return False
    usable = False
    for dev in facts.devices:
        if args.device is not None and dev.name != args.device:
            continue
        if dev.error is not None or dev.limits is None:
            report.fail(f"device {dev.name}: {dev.error}", "check `rdma link` and dmesg for the driver")
            continue
        lim = dev.limits
        netdevs = ", ".join(dev.netdevs) or "none"
        report.ok(
            f"device {dev.name} (netdev {netdevs}): max_qp_wr {lim.max_qp_wr}, max_sge {lim.max_sge}, "
            f"max_cqe {lim.max_cqe}, max_qp_rd_atom {lim.max_qp_rd_atom}"
        )
        for port in dev.ports:
            if port.port != args.port:
                continue
            line = f"device {dev.name} port {port.port}: {port.state_name}, MTU {port.mtu_bytes}"
            if not port.active:
                report.fail(line, f"ip link set {dev.netdevs[0] if dev.netdevs else '<netdev>'} up")
                continue
            report.ok(line)
            try:
                choice = choose_gid(port.gids, link_layer=port.link_layer, requested=None, host=None)
            except MoriioError as exc:
                report.fail(f"device {dev.name} port {port.port}: {exc.args[0]}", exc.hint)
                continue
            for g in port.gids:
                mark = "  <- default" if g.index == choice.entry.index else ""
                report.ok(f"  GID {g.index:>3} {g.type_name:<8} {g.gid}{mark}")
            if port.link_layer == LINK_LAYER_ETHERNET and choice.entry.gid_type != GID_TYPE_ROCE_V2:
                report.warn(
                    f"device {dev.name}: no RoCE v2 GID ({choice.reason})",
                    "give the netdev an IPv4 address; RoCE v2 entries appear for each address",
                )
            else:
                report.ok(f"  GID choice: index {choice.entry.index}: {choice.reason}")
            usable = True
    if not usable:
        report.fail("no RDMA device with an ACTIVE port and a usable GID", facts.hint)
    return usable


def _check_memlock(report: _Report) -> None:
    limit = memlock_limit()
    if limit is None:
        report.ok("memlock limit: unlimited")
    elif limit < _MEMLOCK_MIN:
        report.warn(
            f"memlock limit: {limit >> 10} KiB: registering KV cache for verbs will fail",
            "ulimit -l unlimited (systemd: LimitMEMLOCK=infinity; docker: --ulimit memlock=-1)",
        )
    else:
        report.ok(f"memlock limit: {limit >> 20} MiB")


def _check_loopback(report: _Report, name: str, options: BackendOptions) -> bool:
    try:
        backend = open_backend(name, options)
    except MoriioError as exc:
        report.fail(f"{name} backend: cannot open: {exc.args[0]}", exc.hint)
        return False
    except Exception as exc:  # a broken backend must not take doctor down with it
        report.fail(f"{name} backend: cannot open: {type(exc).__name__}: {exc}")
        return False
    try:
        took = loopback_write(backend)
    except MoriioError as exc:
        report.fail(f"{name} backend: loopback write failed: {exc.args[0]}", exc.hint)
        return False
    except Exception as exc:
        report.fail(f"{name} backend: loopback write failed: {type(exc).__name__}: {exc}")
        return False
    finally:
        backend.close()
    report.ok(f"{name} backend: loopback RDMA WRITE of {_LOOPBACK_BYTES} bytes verified ({took * 1e3:.1f} ms)")
    return True


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> int:
    report = _Report(out)
    out("moriio-async doctor")
    report.ok(f"python {platform.python_version()} ({sys.executable})")
    facts = probe(args.port)
    report.lenient = args.backend != "verbs"  # with tcp or auto, verbs missing is not a failure
    verbs_ok = _check_verbs(report, facts, args)
    _check_memlock(report)
    options = BackendOptions(host=args.host)
    tcp_ok = True
    if not args.no_loopback:
        if verbs_ok:
            verbs = VerbsOptions(device=args.device, ib_port=args.port)
            verbs_ok = _check_loopback(report, "verbs", dataclasses.replace(options, specific=verbs))
        report.lenient = args.backend == "verbs"
        tcp_ok = _check_loopback(report, "tcp", options)
    report.lenient = args.backend != "cma"  # same-host transfers are optional unless asked for
    cma_ok = check_cma(report)
    if cma_ok and not args.no_loopback:
        cma_ok = _check_loopback(report, "cma", options)
    works = {"verbs": verbs_ok, "tcp": tcp_ok, "cma": cma_ok, "auto": verbs_ok or tcp_ok}[args.backend]
    # auto: each session the best transport its peer shares (cma on this host, then verbs, then tcp).
    usable = [name for name, ok in (("cma", cma_ok), ("verbs", verbs_ok), ("tcp", tcp_ok)) if ok]
    chosen = args.backend if args.backend != "auto" else ", ".join(usable) + " (per peer, in this order)"
    if works:
        out(f"result: backend={args.backend} can work (would use {chosen})")
        return 0
    out(f"result: backend={args.backend} cannot work on this node ({report.problems} problem(s) above)")
    return 1
