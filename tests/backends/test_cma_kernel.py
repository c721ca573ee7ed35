"""The cma backend's Linux calls (backends/cma/kernel.py), run for real on this machine where that is safe.

process_vm_readv/writev on this process itself, mmap/munmap of a memfd checked against /proc/self/maps,
the /proc facts read from the real files. Faked only what cannot run here: a Yama file with each value
(this kernel may have none) and a prctl(PR_SET_PTRACER) that succeeds (without Yama it is EINVAL, and
with Yama it would change who may attach to the test process).
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from moriio_async.backends.cma import kernel
from moriio_async.backends.cma.kernel import (
    PR_SET_PTRACER,
    PR_SET_PTRACER_ANY,
    boot_id,
    map_shared,
    memmove,
    process_vm,
    set_ptracer,
    start_time,
    unmap,
    yama_scope,
)

PAGE = os.sysconf("SC_PAGE_SIZE")


def iov(*pairs: tuple[int, int]) -> np.ndarray:
    return np.array(pairs, dtype=np.uint64).reshape(-1, 2)


def address(buf: ctypes.Array[ctypes.c_char]) -> int:
    return ctypes.addressof(buf)


def test_process_vm_reads_from_this_process_into_a_local_buffer() -> None:
    src = ctypes.create_string_buffer(b"abcdefgh", 8)
    dst = ctypes.create_string_buffer(8)
    moved, err = process_vm(os.getpid(), False, iov((address(dst), 8)), iov((address(src), 8)))
    assert (moved, err) == (8, 0)
    assert dst.raw == b"abcdefgh"


def test_process_vm_writes_into_this_process_from_several_iovecs() -> None:
    src = ctypes.create_string_buffer(b"0123456789", 10)
    dst = ctypes.create_string_buffer(10)
    local = iov((address(src), 4), (address(src) + 4, 6))
    remote = iov((address(dst) + 6, 4), (address(dst), 6))
    moved, err = process_vm(os.getpid(), True, local, remote)
    assert (moved, err) == (10, 0)
    assert dst.raw == b"4567890123"


def test_process_vm_of_no_iovecs_moves_nothing_and_succeeds() -> None:
    empty = np.zeros((0, 2), dtype=np.uint64)
    for write in (False, True):
        assert process_vm(os.getpid(), write, empty, empty) == (0, 0)


def test_process_vm_to_no_such_process_is_zero_and_esrch() -> None:
    src = ctypes.create_string_buffer(b"x", 1)
    dst = ctypes.create_string_buffer(1)
    # pid_max is at most 2**22: this pid names no process.
    for write in (False, True):
        assert process_vm(2**22 + 1, write, iov((address(dst), 1)), iov((address(src), 1))) == (0, errno.ESRCH)
    assert dst.raw == b"\0"


def test_process_vm_to_a_bad_remote_address_is_zero_and_efault() -> None:
    dst = ctypes.create_string_buffer(b"\x07" * 4, 4)
    for write in (False, True):
        assert process_vm(os.getpid(), write, iov((address(dst), 4)), iov((8, 4))) == (0, errno.EFAULT)
    assert dst.raw == b"\x07" * 4


def test_process_vm_stops_short_at_the_remote_element_that_fails() -> None:
    src = ctypes.create_string_buffer(b"wxyz", 4)
    dst = ctypes.create_string_buffer(4)
    moved, err = process_vm(os.getpid(), False, iov((address(dst), 4)), iov((address(src), 2), (8, 2)))
    assert (moved, err) == (2, 0)
    assert dst.raw[:2] == b"wx"


def test_memmove_copies_between_raw_addresses() -> None:
    src = ctypes.create_string_buffer(b"hello", 5)
    dst = ctypes.create_string_buffer(5)
    memmove(address(dst), address(src), 5)
    assert dst.raw == b"hello"


@pytest.fixture
def memfd() -> Iterator[int]:
    fd = os.memfd_create("test_cma_kernel")
    os.ftruncate(fd, 2 * PAGE)
    os.pwrite(fd, b"from the fd", 0)
    try:
        yield fd
    finally:
        os.close(fd)


def mapping(addr: int) -> str | None:
    """The permissions column of /proc/self/maps for the mapping that starts at ``addr`` (e.g. "rw-s")."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, perms = line.split()[:2]
        if int(span.split("-")[0], 16) == addr:
            return perms
    return None


def test_map_shared_maps_the_fd_writable_and_shared(memfd: int) -> None:
    addr = map_shared(memfd, 2 * PAGE, True)
    try:
        assert addr % PAGE == 0
        assert mapping(addr) == "rw-s"
        assert ctypes.string_at(addr, 11) == b"from the fd"
        # Shared: a write through the mapping is in the file, at both pages.
        ctypes.memmove(addr + PAGE, b"through the map", 15)
        assert os.pread(memfd, 15, PAGE) == b"through the map"
    finally:
        unmap(addr, 2 * PAGE)
    assert mapping(addr) is None


def test_map_shared_read_only_maps_without_write(memfd: int) -> None:
    addr = map_shared(memfd, PAGE, False)
    try:
        assert mapping(addr) == "r--s"
        os.pwrite(memfd, b"later", 0)
        assert ctypes.string_at(addr, 5) == b"later"
    finally:
        unmap(addr, PAGE)


def vm_flags(addr: int) -> list[str]:
    """The VmFlags of /proc/self/smaps for the mapping that starts at ``addr``."""
    smaps = Path("/proc/self/smaps").read_text()
    block = smaps[smaps.index(f"\n{addr:x}-") :]
    return next(line.split()[1:] for line in block.splitlines() if line.startswith("VmFlags:"))


def test_map_shared_asks_for_huge_pages(memfd: int) -> None:
    addr = map_shared(memfd, 2 * PAGE, True)
    try:
        # madvise(MADV_HUGEPAGE) on the whole mapping: "hg", whatever the kernel then makes of it.
        assert {"rd", "wr", "sh", "hg"} <= set(vm_flags(addr))
    finally:
        unmap(addr, 2 * PAGE)


def test_map_shared_populates_the_pages(memfd: int) -> None:
    addr = map_shared(memfd, 2 * PAGE, False)
    try:
        # MAP_POPULATE faulted both pages in: they are resident before anything touched them.
        vec = (ctypes.c_ubyte * 2)()
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(2 * PAGE), vec) == 0
        assert [b & 1 for b in vec] == [1, 1]
    finally:
        unmap(addr, 2 * PAGE)


def test_map_shared_of_a_bad_fd_raises_oserror_with_the_errno() -> None:
    with pytest.raises(OSError, match=os.strerror(errno.EBADF)) as info:
        map_shared(-1, PAGE, True)
    assert info.value.errno == errno.EBADF
    assert info.value.strerror == f"mmap of {PAGE} bytes: {os.strerror(errno.EBADF)}"


def test_map_shared_writable_of_a_read_only_fd_is_eacces(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"\0" * PAGE)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError, match=os.strerror(errno.EACCES)) as info:
            map_shared(fd, PAGE, True)
        assert info.value.errno == errno.EACCES
        addr = map_shared(fd, PAGE, False)
        unmap(addr, PAGE)
    finally:
        os.close(fd)


def test_unmap_of_an_unaligned_address_raises_oserror_with_the_errno() -> None:
    with pytest.raises(OSError, match=os.strerror(errno.EINVAL)) as info:
        unmap(PAGE + 1, PAGE)
    assert info.value.errno == errno.EINVAL
    assert info.value.strerror == f"munmap: {os.strerror(errno.EINVAL)}"


def test_set_ptracer_is_the_errno_of_a_failing_prctl() -> None:
    # Naming a pid that is no process is EINVAL both without Yama (no such prctl) and with it (no such
    # task), and changes nothing: the one real call that is safe in a test process.
    assert set_ptracer(2**22 + 1) == errno.EINVAL


class FakePrctl:
    def __init__(self, result: int, err: int = 0) -> None:
        self.result = result
        self.err = err
        self.calls: list[tuple[int, ...]] = []

    def __call__(self, *args: int) -> int:
        self.calls.append(args)
        ctypes.set_errno(self.err)
        return self.result


def test_set_ptracer_names_the_pid_and_is_0_on_success(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakePrctl(0)
    monkeypatch.setattr(kernel, "prctl", fake)
    assert set_ptracer(4242) == 0
    assert set_ptracer(PR_SET_PTRACER_ANY) == 0
    # -1 reaches the kernel as (unsigned long)-1, which is what Yama compares PR_SET_PTRACER_ANY with.
    assert fake.calls == [(PR_SET_PTRACER, 4242, 0, 0, 0), (PR_SET_PTRACER, 2**64 - 1, 0, 0, 0)]
    assert PR_SET_PTRACER == 0x59616D61


def test_set_ptracer_is_the_errno_or_eio_when_prctl_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel, "prctl", FakePrctl(-1, errno.EPERM))
    assert set_ptracer(1) == errno.EPERM
    monkeypatch.setattr(kernel, "prctl", FakePrctl(-1, 0))
    assert set_ptracer(1) == errno.EIO


def stat_field_22(text: str) -> int:
    return int(text[text.rfind(")") + 2 :].split()[19])


def test_start_time_is_field_22_of_this_process_stat() -> None:
    expected = stat_field_22(Path(f"/proc/{os.getpid()}/stat").read_text())
    assert start_time(os.getpid()) == expected
    assert start_time(1) == stat_field_22(Path("/proc/1/stat").read_text())


def test_start_time_of_no_such_process_is_none() -> None:
    assert start_time(2**22 + 1) is None


class FakeFile:
    """Stands in for ``Path`` in kernel.py: every path reads as ``data`` (or raises ``error``)."""

    def __init__(self, data: str = "", error: OSError | None = None) -> None:
        self.data = data
        self.error = error
        self.paths: list[str] = []

    def __call__(self, path: str) -> FakeFile:
        self.paths.append(path)
        return self

    def read_text(self) -> str:
        if self.error is not None:
            raise self.error
        return self.data

    def read_bytes(self) -> bytes:
        return self.read_text().encode()


def test_start_time_skips_a_command_name_with_spaces_and_parentheses(monkeypatch: pytest.MonkeyPatch) -> None:
    fields = " ".join(str(n) for n in range(3, 60))  # field 3 onwards: field 22 is 22
    fake = FakeFile(f"77 (a) b (c) {fields}\n")
    monkeypatch.setattr(kernel, "Path", fake)
    assert start_time(77) == 22
    assert fake.paths == ["/proc/77/stat"]


@pytest.mark.parametrize("text", ["77 (x) S 1 2", "77 (x) " + " ".join(["z"] * 30), ""])
def test_start_time_of_a_short_or_garbled_stat_is_none(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setattr(kernel, "Path", FakeFile(text))
    assert start_time(77) is None


def test_boot_id_is_this_kernels_boot_id() -> None:
    got = boot_id()
    assert got == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", got)


def test_boot_id_is_empty_when_unreadable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel, "Path", FakeFile(error=FileNotFoundError(errno.ENOENT, "no")))
    assert boot_id() == ""


def test_yama_scope_agrees_with_this_kernel() -> None:
    path = Path("/proc/sys/kernel/yama/ptrace_scope")
    assert yama_scope() == (int(path.read_text()) if path.exists() else None)


@pytest.mark.parametrize(("text", "scope"), [("0\n", 0), ("1\n", 1), ("2", 2), (" 3 \n", 3)])
def test_yama_scope_reads_the_sysctl(monkeypatch: pytest.MonkeyPatch, text: str, scope: int) -> None:
    fake = FakeFile(text)
    monkeypatch.setattr(kernel, "Path", fake)
    assert yama_scope() == scope
    assert fake.paths == ["/proc/sys/kernel/yama/ptrace_scope"]


@pytest.mark.parametrize(
    "fake",
    [FakeFile(error=FileNotFoundError(errno.ENOENT, "no Yama")), FakeFile(error=PermissionError()), FakeFile("x")],
    ids=["missing", "unreadable", "garbled"],
)
def test_yama_scope_is_none_without_a_readable_sysctl(monkeypatch: pytest.MonkeyPatch, fake: FakeFile) -> None:
    monkeypatch.setattr(kernel, "Path", fake)
    assert yama_scope() is None
