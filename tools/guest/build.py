#!/usr/bin/env python3
"""Build (or find in the cache) everything the Soft-RoCE test guest needs.

The guest is Debian's own kernel (which has rdma_rxe) booted by QEMU with a
tiny busybox initramfs; it chroots into the host's root over 9p, so the host's
Python and this repository are used as they are. Real verbs from Python need
pyverbs and rdma-core 59, which are built here from PyPI's ``pyverbs`` sdist.

Usage::

    python3 tools/guest/build.py               # build if needed, print the cache path
    python3 tools/guest/build.py --print-env   # shell exports to import that pyverbs

Progress lines go to stderr; stdout carries only the result (the cache path, or
the export lines). Everything lands in
``${MORIIO_GUEST_CACHE:-/var/cache/moriio-async/guest}/<key>/``, where the key
names the kernel, the rdma-core/pyverbs version, the Python ABI and a hash of
the initramfs recipe (init.sh and the module list), so changing any of them
builds a new guest. Each step leaves a stamp file, so an interrupted build
resumes and a warm run does no work at all. Standard library only.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from host import BuildError, apt_update, ensure_packages, is_root, kernel_package, log, run
from layout import (
    CYTHON_PIN,
    GUEST_MODULES,
    INIT_SCRIPT,
    PYVERBS_VERSION,
    Layout,
    guest_env,
    layout_for,
    write_manifest,
)

# Module directories deleted from the unpacked kernel (hardware a VM lacks).
PRUNED_MODULE_DIRS: tuple[str, ...] = (
    "sound",
    "net/bluetooth",
    "net/wireless",
    "net/mac80211",
    *(
        f"drivers/{d}"
        for d in (
            "gpu",
            "media",
            "scsi",
            "usb",
            "iio",
            "staging",
            "hid",
            "hwmon",
            "input",
            "platform",
            "md",
            "ata",
            "mtd",
            "comedi",
            "isdn",
            "video",
            "mmc",
            "bluetooth",
            "net/wireless",
            "net/ethernet",
            "net/can",
            "net/usb",
            "infiniband/hw",
        )
    ),
)


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Serialise builds of one cache entry between concurrent runs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another build holding {path}")
            fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def fresh_dir(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


# --------------------------------------------------------------------------- steps


def step_kernel(lay: Layout) -> None:
    lay.downloads.mkdir(parents=True, exist_ok=True)
    debs = sorted(lay.downloads.glob(f"{lay.kernel_pkg}_*.deb"))
    if not debs:
        try:
            run(["apt-get", "download", lay.kernel_pkg], cwd=lay.downloads)
        except BuildError:
            if not is_root():
                raise
            apt_update()  # stale package lists name a .deb the mirror dropped
            run(["apt-get", "download", lay.kernel_pkg], cwd=lay.downloads)
        debs = sorted(lay.downloads.glob(f"{lay.kernel_pkg}_*.deb"))
    if not debs:
        raise BuildError(f"apt-get download left no {lay.kernel_pkg}_*.deb")
    fresh_dir(lay.kernel_dir)
    run(["dpkg-deb", "-x", str(debs[-1]), str(lay.kernel_dir)])
    # Hardware drivers a virtual machine never loads are most of the 400 MB.
    moddir = lay.kernel_dir / "lib" / "modules" / lay.kver / "kernel"
    for rel in PRUNED_MODULE_DIRS:
        shutil.rmtree(moddir / rel, ignore_errors=True)
    shutil.rmtree(lay.kernel_dir / "usr", ignore_errors=True)
    # The .deb ships no modules.dep; Debian's postinst would run depmod.
    run(["depmod", "-b", str(lay.kernel_dir), lay.kver])
    if not lay.vmlinuz.is_file():
        raise BuildError(f"no kernel image at {lay.vmlinuz}")
    debs[-1].unlink()  # 70 MB; the unpacked tree is what we keep


def module_closure(moddir: Path, names: Sequence[str]) -> list[str]:
    """Relative paths of the named modules and everything they depend on."""
    deps: dict[str, list[str]] = {}
    by_name: dict[str, str] = {}
    for line in (moddir / "modules.dep").read_text().splitlines():
        target, _, rest = line.partition(":")
        deps[target] = rest.split()
        by_name[Path(target).name.split(".ko")[0].replace("-", "_")] = target
    wanted: list[str] = []
    todo = []
    for name in names:
        if name not in by_name:
            raise BuildError(f"module {name} not found in {moddir}")
        todo.append(by_name[name])
    while todo:
        path = todo.pop()
        if path not in wanted:
            wanted.append(path)
            todo.extend(deps[path])
    return sorted(wanted)


def step_initramfs(lay: Layout) -> None:
    busybox = Path("/bin/busybox")
    if not busybox.is_file():
        raise BuildError("/bin/busybox is missing (install busybox-static)")
    moddir = lay.kernel_dir / "lib" / "modules" / lay.kver
    with tempfile.TemporaryDirectory(prefix="moriio-initramfs-") as tmp:
        stage = Path(tmp)
        for d in ("bin", "dev", "proc", "sys", "etc", "newroot"):
            (stage / d).mkdir()
        shutil.copy2(busybox, stage / "bin" / "busybox")
        shutil.copy2(INIT_SCRIPT, stage / "init")
        (stage / "init").chmod(0o755)
        (stage / "etc" / "moriio-modules").write_text("\n".join(GUEST_MODULES) + "\n")
        target = stage / "lib" / "modules" / lay.kver
        modules = module_closure(moddir, GUEST_MODULES)
        for rel in modules:
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(moddir / rel, target / rel)
        for extra in ("modules.order", "modules.builtin", "modules.builtin.modinfo"):
            shutil.copy2(moddir / extra, target / extra)
        run(["depmod", "-b", str(stage), lay.kver])
        log(f"initramfs: busybox + {len(modules)} modules")
        partial = lay.initramfs.with_suffix(".partial")
        names = [".", *sorted(str(p.relative_to(stage).as_posix()) for p in stage.rglob("*"))]
        files = "".join(f"./{n}\n" if n != "." else ".\n" for n in names)
        with partial.open("wb") as fh:
            cpio = subprocess.Popen(
                ["cpio", "-o", "-H", "newc", "-R", "0:0", "--quiet"],
                cwd=stage,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            gz = subprocess.Popen(["gzip", "-6", "-n"], stdin=cpio.stdout, stdout=fh)
            assert cpio.stdin is not None
            assert cpio.stdout is not None
            cpio.stdout.close()
            cpio.stdin.write(files.encode())
            cpio.stdin.close()
            if cpio.wait() != 0 or gz.wait() != 0:
                raise BuildError("packing the initramfs failed")
        partial.replace(lay.initramfs)


def pip_env(lay: Layout) -> dict[str, str]:
    constraints = lay.root / "constraints.txt"
    constraints.write_text(CYTHON_PIN + "\n")
    env = dict(os.environ)
    env.update(
        PIP_CONSTRAINT=str(constraints), PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", PIP_NO_CACHE_DIR="1"
    )
    return env


def sdist_path(lay: Layout) -> Path:
    return lay.downloads / f"pyverbs-{PYVERBS_VERSION}.tar.gz"


def step_sdist(lay: Layout) -> None:
    lay.downloads.mkdir(parents=True, exist_ok=True)
    # --no-binary for pyverbs only: ":all:" would also compile Cython itself
    # from source while preparing metadata (5+ minutes on two cores).
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            "pyverbs",
            "-d",
            str(lay.downloads),
            f"pyverbs=={PYVERBS_VERSION}",
        ],
        env=pip_env(lay),
        log_file=lay.root / "pip-download.log",
    )
    if not sdist_path(lay).is_file():
        raise BuildError(f"pip download left no {sdist_path(lay).name}")


def step_pyverbs(lay: Layout) -> None:
    wheels = fresh_dir(lay.root / "wheels")
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-binary",
            "pyverbs",
            "-w",
            str(wheels),
            str(sdist_path(lay)),
        ],
        env=pip_env(lay),
        log_file=lay.root / "pyverbs-wheel.log",
    )
    built = sorted(wheels.glob("pyverbs-*.whl"))
    if not built:
        raise BuildError("pip wheel produced no pyverbs wheel")
    fresh_dir(lay.site)
    run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(lay.site), str(built[-1])],
        env=pip_env(lay),
    )


def step_rdma_core(lay: Layout) -> None:
    src_root = fresh_dir(lay.root / "src")
    with tarfile.open(sdist_path(lay)) as tar:
        tar.extractall(src_root, filter="data")
    source = src_root / f"pyverbs-{PYVERBS_VERSION}" / "rdma-core"
    build = src_root / "build"
    if lay.prefix.exists():
        shutil.rmtree(lay.prefix)
    prefix = str(lay.prefix)
    run(
        [
            "cmake",
            "-S",
            str(source),
            "-B",
            str(build),
            "-GNinja",
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DCMAKE_INSTALL_PREFIX={prefix}",
            "-DCMAKE_INSTALL_LIBDIR=lib",
            # Its default is /lib/systemd (absolute): keep the install in the prefix.
            f"-DCMAKE_INSTALL_SYSTEMD_BINDIR={prefix}/lib/systemd",
            # Runtime-only (ibacm's unix socket path, which must fit in 108 bytes):
            # the default <prefix>/var/run overflows with a long cache path.
            "-DCMAKE_INSTALL_RUNDIR=/run",
            "-DNO_MAN_PAGES=1",
            "-DNO_PYVERBS=1",
            "-DENABLE_VALGRIND=0",
        ],
        log_file=lay.root / "rdma-core-cmake.log",
    )
    run(["ninja", "-C", str(build), "install"], log_file=lay.root / "rdma-core-ninja.log")
    outside = [
        line for line in (build / "install_manifest.txt").read_text().splitlines() if not line.startswith(prefix + "/")
    ]
    if outside:
        raise BuildError(f"rdma-core installed files outside its prefix: {outside[:5]}")
    if not sorted((lay.prefix / "lib" / "libibverbs").glob("librxe*.so")):
        raise BuildError("rdma-core built without the rxe provider")
    shutil.rmtree(src_root)


def step_check_import(lay: Layout) -> None:
    """Import pyverbs against the fresh libraries (no device is needed)."""
    env = dict(os.environ, **guest_env(lay))
    run(
        [
            sys.executable,
            "-c",
            "import pyverbs.device, pyverbs.cq, pyverbs.qp, pyverbs.mr, pyverbs.pd; print(pyverbs.__file__)",
        ],
        env=env,
    )


STEPS = (
    ("kernel", step_kernel),
    ("initramfs", step_initramfs),
    ("sdist", step_sdist),
    ("rdma_core", step_rdma_core),
    ("pyverbs", step_pyverbs),
    ("import", step_check_import),
)


def ensure_built(*, install_packages: bool = True) -> Layout:
    """Make sure the cached guest exists; return its layout. Idempotent."""
    t0 = time.monotonic()
    durations: dict[str, float] = {}
    if install_packages:
        spent = ensure_packages()
        if spent:
            durations["apt"] = spent
    lay = layout_for(kernel_package())
    if all(lay.stamp(name).exists() for name, _ in STEPS):
        log(f"cache hit: {lay.root}")
        return lay
    lay.root.mkdir(parents=True, exist_ok=True)
    with locked(lay.root.with_name(lay.root.name + ".lock")):
        for name, func in STEPS:
            if lay.stamp(name).exists():
                continue
            log(f"step {name}: start")
            start = time.monotonic()
            func(lay)
            durations[name] = time.monotonic() - start
            lay.stamp(name).touch()
            write_manifest(lay, durations)  # after each step: a failed build keeps its timings
            log(f"step {name}: done in {durations[name]:.1f}s")
    log(f"built {lay.root} in {time.monotonic() - t0:.1f}s")
    return lay


def print_env(lay: Layout) -> None:
    env = guest_env(lay)
    for name in ("LD_LIBRARY_PATH", "PYTHONPATH"):
        print(f"export {name}={shlex.quote(env[name])}${{{name}:+:${name}}}")
    print(f"export MORIIO_RDMA_CORE_PREFIX={shlex.quote(env['MORIIO_RDMA_CORE_PREFIX'])}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--print-env", action="store_true", help="print shell export lines for the cached pyverbs")
    args = parser.parse_args(argv)
    try:
        lay = ensure_built()
    except BuildError as exc:
        log(f"FAILED: {exc}")
        return 1
    if args.print_env:
        print_env(lay)
    else:
        print(lay.root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
