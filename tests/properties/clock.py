"""Loop time a test controls: deadlines without sleeping, where the loop allows it.

``VirtualClock`` makes an asyncio loop's time jump to its next timer
whenever the loop would otherwise sleep, so a 30-second deadline passes at
once and every timer fires in exactly the order its time says. uvloop's
clock lives in libuv and cannot be replaced: there the clock stays real, and
tests keep their timed actions well away from the deadline instead.

Virtual time is real time plus every jump so far. The jump happens only when nothing else can make progress: no file
descriptor is ready (checked with a short real wait, for loopback sockets),
and no job is running in the loop's executor (counted), since a thread that
finishes later would otherwise find its caller's timeout already fired.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable
from types import TracebackType
from typing import Any

GRACE = 0.002
"""Real seconds the loop may wait for a socket before virtual time moves on."""


class VirtualClock:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.virtual = isinstance(loop, asyncio.BaseEventLoop) and hasattr(loop, "_selector")
        self.jumped = 0.0
        self._busy = 0
        self._undo: list[Callable[[], None]] = []

    def __enter__(self) -> VirtualClock:
        if not self.virtual:
            return self
        loop: Any = self.loop
        real_time: Callable[[], float] = loop.time
        selector: selectors.BaseSelector = loop._selector
        real_select = selector.select
        real_run_in_executor = loop.run_in_executor

        def select(timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
            events = real_select(0)
            if events or timeout == 0:
                return events
            if timeout is None or self._busy:
                return real_select(timeout if timeout is None else min(timeout, 0.05))
            events = real_select(min(timeout, GRACE))
            if not events:
                self.jumped += timeout
            return events

        def run_in_executor(executor: Any, func: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
            self._busy += 1
            fut: asyncio.Future[Any] = real_run_in_executor(executor, func, *args)

            def done(_: object) -> None:
                self._busy -= 1

            fut.add_done_callback(done)
            return fut

        loop.time = lambda: real_time() + self.jumped
        selector.select = select  # type: ignore[method-assign]
        loop.run_in_executor = run_in_executor
        self._undo = [
            lambda: delattr(loop, "time"),
            lambda: delattr(selector, "select"),
            lambda: delattr(loop, "run_in_executor"),
        ]
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo = []
