"""``TransferStatus`` and ``wait_all``: MoRI-IO's blocking status surface, thread-safe.

A status is written by the engine's event loop (from the completion reader,
through the transfer's done callback) and read or waited on by any thread.
``Wait``/``WaitFor`` block on a ``threading.Condition``, which releases the
GIL while blocked, so other Python threads run while one waits.

Spinning on a check (``while status.InProgress(): pass``, MoRI-IO's own
idiom, whose C++ checks release the GIL) would hold the GIL, so the engine's
loop thread could finish the transfer only once per switch interval (5 ms).
A check that finds the status not ended less than ``SPIN_GAP`` after the
previous such check of the same status first waits up to ``SPIN_WAIT`` for
it to end, with the GIL released: a spinning caller lets the engine progress
and wakes as soon as the status ends; a caller that checks now and then pays
nothing more than reading a clock (kept in the status: a thread-local would
cost more than the check itself).

``Update`` keeps MoRI-IO's rule: once a status holds a failure, later updates
are ignored (a success may still be overwritten by a failure through
``Update``, as in MoRI-IO; the runtime itself ends each status once).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from .enums import ERR_BEGIN, StatusCode

__all__ = ["SPIN_GAP", "SPIN_WAIT", "TransferStatus", "wait_all"]

SPIN_GAP = 100e-6
"""Seconds: a check of a status not ended this soon after the previous one that found it so is a spin."""
SPIN_WAIT = 1e-3
"""Seconds a spinning check waits (GIL released) for the status to end before it answers."""

LoopGuard = Callable[[str], None]
"""Raises when called on a thread that must not block (the engine's own loop thread)."""


class TransferStatus:
    """The outcome of one transfer call, as MoRI-IO's ``TransferStatus``.

    ``TransferStatus()`` starts at ``INIT``; a transfer call returns one that is
    already ``IN_PROGRESS`` or ended. ``loop_guard`` (not in MoRI-IO) makes a
    blocking wait on the engine's own loop thread raise instead of deadlocking.
    """

    __slots__ = ("_checked", "_code", "_cond", "_loop_guard", "_message")

    def __init__(self, *, loop_guard: LoopGuard | None = None) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._code = StatusCode.INIT
        self._message = ""
        self._loop_guard = loop_guard
        self._checked = -1.0  # when a check last found it not ended (time.perf_counter)

    def Code(self) -> StatusCode:
        return self._look()

    def Message(self) -> str:
        with self._cond:
            return self._message

    def Init(self) -> bool:
        return self._look() is StatusCode.INIT

    def InProgress(self) -> bool:
        return self._look() is StatusCode.IN_PROGRESS

    def Succeeded(self) -> bool:
        return self._look() is StatusCode.SUCCESS

    def Failed(self) -> bool:
        return self._look() > ERR_BEGIN

    def _look(self) -> StatusCode:
        """The code; when not ended and the calling thread is spinning, after a short wait for the end."""
        code = self._code
        if code is not StatusCode.IN_PROGRESS and code is not StatusCode.INIT:
            return code
        now = time.perf_counter()
        if now - self._checked < SPIN_GAP and not self._on_loop_thread():
            with self._cond:
                self._cond.wait_for(self._settled, SPIN_WAIT)
                code = self._code
            now = time.perf_counter()
        self._checked = now
        return code

    def _on_loop_thread(self) -> bool:
        """The engine's loop thread must not wait here: it is the thread that ends the status."""
        if self._loop_guard is None:
            return False
        try:
            self._loop_guard("TransferStatus check")
        except RuntimeError:
            return True
        return False

    def _settled(self) -> bool:
        return self._code is not StatusCode.IN_PROGRESS and self._code is not StatusCode.INIT

    def Update(self, code: int, message: str) -> None:
        """Set code and message together, unless the status already holds a failure."""
        with self._cond:
            if self._code > ERR_BEGIN:
                return
            self._message = message
            self._code = StatusCode(int(code))
            self._cond.notify_all()

    def SetCode(self, code: int) -> None:
        with self._cond:
            self._code = StatusCode(int(code))
            if self._code is not StatusCode.IN_PROGRESS and self._code is not StatusCode.INIT:
                self._cond.notify_all()

    def SetMessage(self, message: str) -> None:
        with self._cond:
            self._message = message

    def Wait(self) -> None:
        """Block (GIL released) until the status leaves IN_PROGRESS."""
        self.WaitFor(-1)

    def WaitFor(self, timeout_ms: int = -1) -> StatusCode:
        """Block up to ``timeout_ms`` (< 0: forever; 0: look once) and return the code,
        which is still IN_PROGRESS if the wait timed out. A status that is not
        IN_PROGRESS (INIT included) returns at once, as in MoRI-IO."""
        code = self._code
        if code is not StatusCode.IN_PROGRESS or timeout_ms == 0:
            return code
        if self._loop_guard is not None:
            self._loop_guard("TransferStatus.Wait/WaitFor")
        with self._cond:
            self._cond.wait_for(self._ended, None if timeout_ms < 0 else timeout_ms / 1000)
            return self._code

    def _ended(self) -> bool:
        return self._code is not StatusCode.IN_PROGRESS

    def __repr__(self) -> str:
        return f"<TransferStatus {self._code}>"


def wait_all(statuses: Iterable[TransferStatus | None], timeout_ms: int = -1) -> StatusCode:
    """MoRI-IO's ``WaitAll``: wait for every status; a failure wins over everything else.

    Empty input succeeds; ``None`` entries are skipped. ``timeout_ms < 0`` waits
    for all and returns the first failure in list order, else SUCCESS.
    ``timeout_ms == 0`` looks once: a failure anywhere wins, then IN_PROGRESS
    if anything is still pending. ``timeout_ms > 0`` waits in list order until
    the deadline: the first failure seen, else IN_PROGRESS if the deadline
    passed with something pending, else SUCCESS.
    """
    items = [s for s in statuses if s is not None]
    if timeout_ms == 0:
        pending = False
        for status in items:
            rc = status.WaitFor(0)
            if rc is StatusCode.IN_PROGRESS:
                pending = True
            elif rc is not StatusCode.SUCCESS:
                return rc
        return StatusCode.IN_PROGRESS if pending else StatusCode.SUCCESS
    first_error = StatusCode.SUCCESS
    deadline = None if timeout_ms < 0 else time.monotonic() + timeout_ms / 1000
    for status in items:
        remaining = -1
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return first_error if first_error is not StatusCode.SUCCESS else StatusCode.IN_PROGRESS
            remaining = max(1, int(left * 1000))
        rc = status.WaitFor(remaining)
        if rc is StatusCode.IN_PROGRESS:
            return first_error if first_error is not StatusCode.SUCCESS else StatusCode.IN_PROGRESS
        if rc is not StatusCode.SUCCESS and first_error is StatusCode.SUCCESS:
            first_error = rc
    return first_error
