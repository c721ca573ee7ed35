"""Byte streams over iovec arrays: windows, transfers with cross-memory attach, and plain copies.

A chunk of requests is two iovec lists describing the same byte stream: the
local SGEs and the remote ranges. Both are ``(n, 2)`` uint64 arrays of
(address, length) built in one pass from the batch's columns; a window of the
stream (a piece of a huge request, or one thread's share) is cut from them
with a cumulative sum and two binary searches, never a Python loop per block.
"""

from __future__ import annotations

import errno
import functools
import itertools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import numpy.typing as npt

from .kernel import IOV_MAX, memmove, process_vm

__all__ = ["Iov", "Mover", "iovecs", "segments", "window"]

Iov = npt.NDArray[np.uint64]
ALIGN = 1 << 12
"""A thread's share of a window starts on a page boundary of the stream."""


def iovecs(addrs: npt.NDArray[np.uint64], lengths: npt.NDArray[np.uint64]) -> Iov:
    """An ``(n, 2)`` iovec array from address and length columns (one pass, C order)."""
    out = np.empty((len(addrs), 2), dtype=np.uint64)
    out[:, 0] = addrs
    out[:, 1] = lengths
    return out


def window(iov: Iov, start: int, stop: int, ends: npt.NDArray[np.uint64] | None = None) -> Iov:
    """The rows of ``iov`` that carry bytes ``start:stop`` of its stream, trimmed to them (a copy)."""
    if ends is None:
        ends = np.cumsum(iov[:, 1])
    i = int(np.searchsorted(ends, start, side="right"))
    j = int(np.searchsorted(ends, stop, side="left"))
    out = iov[i : j + 1].copy()
    cut = start - (int(ends[i]) - int(iov[i, 1]))
    out[0, 0] += np.uint64(cut)
    out[0, 1] -= np.uint64(cut)
    out[-1, 1] -= np.uint64(int(ends[j]) - stop)
    return out


def segments(local: Iov, remote: Iov) -> tuple[list[int], list[int], list[int]]:
    """The stream cut where either list's rows end: (local address, remote address, length) per piece."""
    if len(local) == len(remote) and np.array_equal(local[:, 1], remote[:, 1]):
        return local[:, 0].tolist(), remote[:, 0].tolist(), local[:, 1].tolist()
    le, re_ = np.cumsum(local[:, 1]), np.cumsum(remote[:, 1])
    cuts = np.union1d(le, re_)
    cuts = cuts[cuts > 0]
    starts = np.concatenate((np.zeros(1, np.uint64), cuts[:-1]))
    li = np.searchsorted(le, starts, side="right")
    ri = np.searchsorted(re_, starts, side="right")
    laddr = local[li, 0] + (starts - (le[li] - local[li, 1]))
    raddr = remote[ri, 0] + (starts - (re_[ri] - remote[ri, 1]))
    return laddr.tolist(), raddr.tolist(), (cuts - starts).tolist()


def _cma(pid: int, write: bool, local: Iov, remote: Iov, total: int) -> tuple[int, int]:
    """Move ``total`` bytes with process_vm_readv/writev, through partial transfers; (moved, errno)."""
    done = 0
    lends: npt.NDArray[np.uint64] | None = None
    rends: npt.NDArray[np.uint64] | None = None
    while done < total:
        if done or len(local) > IOV_MAX or len(remote) > IOV_MAX:
            if lends is None or rends is None:
                lends, rends = np.cumsum(local[:, 1]), np.cumsum(remote[:, 1])
            stop = total
            if len(local) > IOV_MAX or len(remote) > IOV_MAX:
                # At most IOV_MAX rows per side from ``done`` on.
                li = int(np.searchsorted(lends, done, side="right"))
                ri = int(np.searchsorted(rends, done, side="right"))
                if li + IOV_MAX < len(local):
                    stop = min(stop, int(lends[li + IOV_MAX - 1]))
                if ri + IOV_MAX < len(remote):
                    stop = min(stop, int(rends[ri + IOV_MAX - 1]))
            lw, rw = window(local, done, stop, lends), window(remote, done, stop, rends)
        else:
            lw, rw = local, remote
        got, err = process_vm(pid, write, lw, rw)
        if err:
            return done, err
        if not got:
            return done, errno.EFAULT
        done += got
    return done, 0


def _copy(write: bool, local: Iov, remote: Iov) -> None:
    """A plain copy between local memory and a shared mapping (``remote`` holds mapped addresses)."""
    laddr, raddr, lengths = segments(local, remote)
    if write:
        for lo, ra, n in zip(laddr, raddr, lengths, strict=True):
            memmove(ra, lo, n)
    else:
        for lo, ra, n in zip(laddr, raddr, lengths, strict=True):
            memmove(lo, ra, n)


class Mover:
    """Moves a window of a stream, on the calling thread or split over ``threads`` threads."""

    def __init__(self, threads: int, split_bytes: int, name: str) -> None:
        self.threads = max(1, threads)
        self.split_bytes = split_bytes
        self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix=name) if self.threads > 1 else None

    def move(self, pid: int, shared: bool, write: bool, local: Iov, remote: Iov, total: int) -> tuple[int, int]:
        """Move the whole stream; (bytes moved before the first failure, errno or 0).

        ``shared``: ``remote`` holds addresses of this process's mappings (a plain copy,
        which cannot fail); else they are the target's (cross-memory attach).
        """

        def run(lw: Iov, rw: Iov, n: int) -> tuple[int, int]:
            if shared:
                _copy(write, lw, rw)
                return n, 0
            return _cma(pid, write, lw, rw, n)

        if self._pool is None or total < self.split_bytes:
            return run(local, remote, total)
        k = self.threads
        cuts = [0, *[(total * i // k) // ALIGN * ALIGN for i in range(1, k)], total]
        spans = [(a, b) for a, b in itertools.pairwise(cuts) if b > a]
        lends, rends = np.cumsum(local[:, 1]), np.cumsum(remote[:, 1])
        parts: list[Callable[[], tuple[int, int]]] = []
        for a, b in spans:
            lw, rw = window(local, a, b, lends), window(remote, a, b, rends)
            parts.append(functools.partial(run, lw, rw, b - a))
        futures = [self._pool.submit(p) for p in parts[1:]]
        results = [parts[0]()] + [f.result() for f in futures]
        for (got, err), (a, b) in zip(results, spans, strict=True):
            if err or got < b - a:
                return a + got, err or errno.EFAULT
        return total, 0

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
