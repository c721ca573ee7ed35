"""Where a built guest lives: the cache key, the paths inside one entry, its manifest.

The key names the kernel, the rdma-core/pyverbs version, the Python ABI and a
hash of the initramfs recipe, so changing any of them builds a new guest
(``build.py``); ``run.py`` reads the same layout to boot it. Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
INIT_SCRIPT = HERE / "init.sh"
STAGE2_SCRIPT = HERE / "stage2.sh"

DEFAULT_CACHE = "/var/cache/moriio-async/guest"
PYVERBS_VERSION = "59.0"
# Cython 3.1 and newer stop in mlx5dv_flow.pyx ("Unmatched ')'") on this sdist.
CYTHON_PIN = "cython==3.0.12"
# Bump when the build steps change in a way the key would not notice.
RECIPE = "3"

# Loaded in this order by /init. crc32_generic must precede rdma_rxe; the
# initramfs carries exactly these modules and their dependencies.
GUEST_MODULES: tuple[str, ...] = (
    "virtio_pci",
    "9pnet_virtio",
    "9p",
    "overlay",
    "virtio_net",
    "veth",
    "crc32_generic",
    "rdma_rxe",
    "ib_uverbs",
    "rdma_ucm",
    "sch_netem",
)

# --------------------------------------------------------------------------- layout


def python_tag() -> str:
    return f"cp{sys.version_info.major}{sys.version_info.minor}"


def recipe_hash() -> str:
    h = hashlib.sha256()
    h.update(INIT_SCRIPT.read_bytes())
    h.update("\n".join(GUEST_MODULES).encode())
    h.update(f"{RECIPE}|{CYTHON_PIN}".encode())
    return h.hexdigest()[:12]


def cache_root() -> Path:
    return Path(os.environ.get("MORIIO_GUEST_CACHE") or DEFAULT_CACHE)


@dataclass(frozen=True)
class Layout:
    """Where everything lives inside one cache entry."""

    root: Path
    kernel_pkg: str

    @property
    def kver(self) -> str:
        return self.kernel_pkg.removeprefix("linux-image-")

    @property
    def downloads(self) -> Path:
        return self.root / "downloads"

    @property
    def kernel_dir(self) -> Path:
        """dpkg -x of the kernel package; also the modprobe -d root in the guest."""
        return self.root / "kernel"

    @property
    def vmlinuz(self) -> Path:
        return self.kernel_dir / "boot" / f"vmlinuz-{self.kver}"

    @property
    def initramfs(self) -> Path:
        return self.root / "initramfs.cpio.gz"

    @property
    def prefix(self) -> Path:
        """rdma-core 59 install prefix (libibverbs, providers, ibv_* tools)."""
        return self.root / "rdma-core"

    @property
    def site(self) -> Path:
        """pip --target directory holding the pyverbs package."""
        return self.root / "site"

    @property
    def manifest(self) -> Path:
        return self.root / "manifest.json"

    def stamp(self, step: str) -> Path:
        return self.root / f".{step}.done"


def layout_for(kernel_pkg: str) -> Layout:
    kver = kernel_pkg.removeprefix("linux-image-")
    key = f"linux-{kver}_pyverbs-{PYVERBS_VERSION}_{python_tag()}_{recipe_hash()}"
    return Layout(root=cache_root() / key, kernel_pkg=kernel_pkg)


def guest_env(lay: Layout) -> dict[str, str]:
    """Variables that make ``import pyverbs`` load the cached build."""
    return {
        "LD_LIBRARY_PATH": str(lay.prefix / "lib"),
        "PYTHONPATH": str(lay.site),
        "MORIIO_RDMA_CORE_PREFIX": str(lay.prefix),
    }


def du_bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with suppress(OSError):
                total += (Path(dirpath) / name).lstat().st_blocks * 512
    return total


def write_manifest(lay: Layout, durations: dict[str, float]) -> None:
    old: dict[str, object] = {}
    if lay.manifest.exists():
        old = json.loads(lay.manifest.read_text())
    old_durations = old.get("build_seconds")
    merged = dict(old_durations) if isinstance(old_durations, dict) else {}
    merged.update({k: round(v, 1) for k, v in durations.items()})
    manifest = {
        "key": lay.root.name,
        "kernel_package": lay.kernel_pkg,
        "kernel_version": lay.kver,
        "pyverbs_version": PYVERBS_VERSION,
        "rdma_core_version": PYVERBS_VERSION.split(".")[0],
        "cython_pin": CYTHON_PIN,
        "python": sys.executable,
        "python_version": platform.python_version(),
        "recipe_hash": recipe_hash(),
        "modules": list(GUEST_MODULES),
        "paths": {
            "root": str(lay.root),
            "vmlinuz": str(lay.vmlinuz),
            "initramfs": str(lay.initramfs),
            "kernel_root": str(lay.kernel_dir),
            "rdma_core_prefix": str(lay.prefix),
            "pyverbs_site": str(lay.site),
        },
        "env": guest_env(lay),
        "build_seconds": merged,
        "disk_bytes": du_bytes(lay.root),
    }
    lay.manifest.write_text(json.dumps(manifest, indent=2) + "\n")
