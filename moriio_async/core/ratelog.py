"""Logging that a hostile peer cannot turn into a flood: at most a few lines per key per interval.

A peer that sends a thousand bad frames, guesses rkeys or fails its proof in a
loop gets one WARNING line per ``interval`` per key (say, per remote
address), and the next line that gets through says how many were held back.

A peer that varies its key (every address of 127/8 locally, a /64 remotely)
would get a line per key: so every key also shares one global budget
(``global_burst`` lines per ``interval``). Past it, lines are held back
whatever their key, and the first call after the global window closes logs
one summary line first: "N more line(s) suppressed".
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    """``log(key, msg, *args)`` emits at most ``burst`` lines per ``interval`` seconds per key, and at most
    ``global_burst`` per ``interval`` over all keys (then one "N more suppressed" line when the next window opens).

    Keys are bounded (``max_keys``, least recently used dropped) so the
    limiter itself cannot be grown by a peer that varies its key. Thread-safe:
    NIC threads and the event loop share one limiter.
    """

    def __init__(
        self,
        logger: logging.Logger,
        level: int = logging.WARNING,
        *,
        interval: float = 10.0,
        burst: int = 1,
        max_keys: int = 1024,
        global_burst: int = 20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._level = level
        self._interval = interval
        self._burst = burst
        self._max_keys = max_keys
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: OrderedDict[str, list[float]] = OrderedDict()  # key -> [window start, sent, held back]
        self._global_burst = global_burst
        self._global = [clock(), 0, 0]  # [window start, sent, held back by the global budget], every key
        self.suppressed = 0
        """Lines held back so far (all keys): for statistics."""

    @property
    def tracked_keys(self) -> int:
        return len(self._windows)

    def log(self, key: str, msg: str, *args: object) -> bool:
        """Log unless ``key`` (or every key together) is over its budget; True when the line was emitted."""
        now = self._clock()
        summary = 0
        with self._lock:
            every = self._global
            if now - every[0] >= self._interval:
                summary = int(every[2])
                self._global = every = [now, 0, 0]
            window = self._windows.get(key)
            if window is None or now - window[0] >= self._interval:
                held = int(window[2]) if window is not None else 0
                window = [now, 0.0, 0.0]
                self._windows[key] = window
                self._windows.move_to_end(key)  # assigning keeps a known key's old place: renewed is recent
                if len(self._windows) > self._max_keys:
                    self._windows.popitem(last=False)
            else:
                held = 0
                self._windows.move_to_end(key)
            if window[1] >= self._burst:
                window[2] += 1
                self.suppressed += 1
                emitted = False
            elif every[1] >= self._global_burst:
                # Over the global budget: held back without a per-key count (the summary says it).
                every[2] += 1 + held
                self.suppressed += 1
                emitted = False
            else:
                window[1] += 1
                every[1] += 1
                emitted = True
        if summary:
            self._logger.log(
                self._level,
                "%d more line(s) suppressed in the last %gs (over %d lines from all sources)",
                summary, self._interval, self._global_burst,
            )  # fmt: skip
        if not emitted:
            return False
        if held:
            msg = f"{msg} ({held} similar line(s) held back in the last {self._interval:g}s)"
        self._logger.log(self._level, msg, *args)
        return True
