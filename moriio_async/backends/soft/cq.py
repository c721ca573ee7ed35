"""The software completion queue the TCP and mock backends share: a locked deque and an eventfd channel.

NIC threads (or, in the mock, the posting thread) push; the event-loop thread
polls. The channel follows ``ibv_req_notify_cq``: ``req_notify`` arms, and the
first push while armed disarms and writes the eventfd. The armed flag is read
and cleared under the same lock that appends, so a consumer that arms and then
polls until empty either finds a completion in the deque or gets the eventfd
write: no wakeup is lost between its last poll and its next wait.

Each entry carries the send-queue slots it frees once polled (the requests its
completion covers), so slots come back exactly when the contract says.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Iterable
from typing import Protocol

from ...work import WorkCompletion
from ..base import CompletionQueue

__all__ = ["SlotOwner", "SoftCompletionQueue"]


class SlotOwner(Protocol):
    def release_slots(self, n: int) -> None:
        """``n`` send-queue slots are free again (called under the queue's lock, by the poller)."""


class SoftCompletionQueue(CompletionQueue):
    """``notify=False`` never writes the channel: a NIC that lost its wakeups, for tests of
    what only an explicit drain finds."""

    def __init__(self, depth: int, *, notify: bool = True) -> None:
        self.depth = depth  # advisory: the deque grows as needed (a verbs CQ overrun is fatal; here nothing is lost)
        self._notify = notify
        self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._lock = threading.Lock()
        self._entries: deque[tuple[WorkCompletion, SlotOwner, int]] = deque()
        self._armed = False

    def fileno(self) -> int:
        return self._fd

    def req_notify(self) -> None:
        with self._lock:
            self._armed = True

    def get_event(self) -> bool:
        try:
            os.eventfd_read(self._fd)
        except (BlockingIOError, OSError):
            return False
        return True

    def push(self, wc: WorkCompletion, owner: SlotOwner, slots: int) -> None:
        """Add one completion that, once polled, frees ``slots`` slots of ``owner``."""
        with self._lock:
            self._entries.append((wc, owner, slots))
            if self._armed:
                self._wake_locked()

    def push_many(self, completions: Iterable[tuple[WorkCompletion, int]], owner: SlotOwner) -> None:
        """Add completions, each with the slots it frees, under one lock acquisition (one wakeup)."""
        with self._lock:
            self._entries.extend((wc, owner, slots) for wc, slots in completions)
            self._wake_locked()

    def _wake_locked(self) -> None:
        if self._armed and self._notify:
            self._armed = False
            # Written under the lock so close() cannot close the fd under us.
            if self._fd >= 0:
                os.eventfd_write(self._fd, 1)

    def poll(self, max_entries: int = 64) -> list[WorkCompletion]:
        out: list[WorkCompletion] = []
        with self._lock:
            entries = self._entries
            for _ in range(min(max_entries, len(entries))):
                wc, owner, slots = entries.popleft()
                owner.release_slots(slots)
                out.append(wc)
        return out

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def close(self) -> None:
        """Close the channel. Completions already queued can still be polled. Idempotent."""
        with self._lock:
            fd, self._fd = self._fd, -1
            self._armed = False
        if fd >= 0:
            os.close(fd)
