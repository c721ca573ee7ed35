"""The initiator's in-use word: which of the target's slots a window is moving bytes of right now.

It closes the one gap a revocation message leaves: a copy that passed its
check just before the target revoked the region. The initiator owns a page
(a sealed memfd it passes to the target in its ``ready``) and, for every
window, stores the slot it will touch (``slot + 1``, or ``ANY`` for several)
*before* it checks the table, and 0 after the copy. The target, in
``deregister_memory``, clears the slot's flags in the table *before* it reads
each initiator's word. With a full fence between each side's store and load
(Dekker's protocol), either the initiator's check sees the revocation (and
moves nothing) or the target sees the word (and waits for that one window,
about a millisecond, never for the peer's goodwill: it gives up after
``revoke_wait`` and cuts the connection off). So once deregistration
returns, a cooperating initiator moves no byte of the region.

The fence is a lock acquire and release (a ``lock``-prefixed instruction on
x86-64, a full barrier there). On weakly ordered CPUs this needs a real
``atomic_thread_fence``; this backend is tested on x86-64.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable
from typing import Final

import numpy as np

from .table import seal_fd, seal_writes

__all__ = ["ANY", "PAGE", "InUse", "InUseView", "fence", "tag_for"]

PAGE: Final = 4096
ANY: Final = 0xFFFFFFFF
_FENCE = threading.Lock()


def fence() -> None:
    """A full memory barrier (see the module docstring)."""
    _FENCE.acquire()
    _FENCE.release()


def tag_for(slots: np.ndarray) -> int:
    """The word for a window touching ``slots`` (target table slots)."""
    first = int(slots[0])
    return first + 1 if len(slots) == 1 or bool((slots == first).all()) else ANY


class InUse:
    """The initiator's side: the page it owns and writes."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("moriio-cma-inuse", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, PAGE)
            seal_fd(self.fd)
            self._map = mmap.mmap(self.fd, PAGE)
            seal_writes(self.fd)  # the target only reads the word: only this mapping may write it
        except BaseException:
            if hasattr(self, "_map"):
                self._map.close()
            os.close(self.fd)
            raise
        self.word = np.frombuffer(self._map, dtype=np.uint32)

    def enter(self, tag: int) -> None:
        """Announce the window, then fence: the table check that follows sees any earlier revocation."""
        self.word[0] = tag
        fence()

    def leave(self) -> None:
        self.word[0] = 0

    def close(self) -> None:
        del self.word
        self._map.close()
        os.close(self.fd)


class InUseView:
    """The target's side: the initiator's page, mapped read-only."""

    def __init__(self, fd: int) -> None:
        if os.fstat(fd).st_size != PAGE:
            raise ValueError("not an in-use page")
        self._map = mmap.mmap(fd, PAGE, prot=mmap.PROT_READ)
        self.word = np.frombuffer(self._map, dtype=np.uint32)
        self._lock = threading.Lock()  # a wait in another thread (close, deregistration) never reads an unmapped page
        self._closed = False

    def read(self) -> int:
        """The initiator's word now; 0 once closed (its connection ended: it moves nothing more)."""
        with self._lock:
            return 0 if self._closed else int(self.word[0])

    def wait_clear(self, slot: int | None, deadline: float, gone: Callable[[], bool]) -> bool:
        """Wait until no window of this initiator touches ``slot`` (None: any slot) (the caller fenced
        after revoking), or the initiator is ``gone`` (a killed one leaves its word set); False at
        ``deadline``."""
        mine = -1 if slot is None else slot + 1
        pause = 0.0
        while True:
            word = self.read()
            idle = not word if slot is None else word != mine and word != ANY
            if idle or gone():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)  # 0 first: yield to the copying thread (two cores may be all there is)
            pause = min(0.001, pause * 2 or 0.00002)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            del self.word
            self._map.close()
