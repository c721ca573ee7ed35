"""``LoopThread``: an event loop on a thread of its own, and the only bridge into it.

Blocking callers cross with ``asyncio.run_coroutine_threadsafe`` (``run``) or
``call_soon_threadsafe`` (``call``, ``post``); the futures they wait on block
on a lock, which releases the GIL. A call that would block on the loop from
the loop's own thread raises instead of deadlocking.

``close_before_exit`` closes what is still open when the interpreter exits,
early enough for the close to work (vLLM never closes its engine).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import concurrent.futures.thread  # registers its exit hook before ours: see close_before_exit
import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar, TypeVarTuple

__all__ = ["LoopThread", "close_before_exit", "new_event_loop"]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")
log = logging.getLogger("moriio_async")

_closers: list[weakref.finalize[Any, Any]] = []
_closers_lock = threading.Lock()
_hooked = False


def close_before_exit(closer: weakref.finalize[Any, Any]) -> None:
    """Call ``closer`` (if still alive) as soon as the interpreter begins to exit, newest first.

    Why not ``atexit`` (where a live ``weakref.finalize`` runs): threading's shutdown runs before
    ``atexit``, and concurrent.futures hooks into it (``threading._register_atexit``) to make every
    executor refuse new work and to join every executor thread. An engine closed from ``atexit``
    finds ``run_in_executor`` refusing, and a thread still busy in an executor (a queue pair being
    connected) would hold the exit before we even start. Threading's exit hooks run in reverse order
    of registration, and concurrent.futures.thread is imported above, so ours runs first: the close
    runs while the loop thread, the executors and the backends' threads all still work. Non-daemon
    threads are joined only after these hooks: one still using an engine then sees it closed.
    """
    global _hooked
    with _closers_lock:
        _closers[:] = [c for c in _closers if c.alive]
        _closers.append(closer)
        if _hooked:
            return
        _hooked = True
    register: Callable[[Callable[[], None]], None] | None = getattr(threading, "_register_atexit", None)
    if register is None:
        return  # not CPython: the finalizer's own atexit call (and the engine's inline close) remain
    with contextlib.suppress(RuntimeError):  # created while the interpreter was already exiting: as above
        register(_close_all)


def _close_all() -> None:
    with _closers_lock:
        closers, _closers[:] = _closers[::-1], []
    for closer in closers:
        try:
            closer()
        except Exception:
            log.exception("moriio_async compat: closing an engine at exit failed")


def new_event_loop(kind: str | None = None) -> asyncio.AbstractEventLoop:
    """uvloop when installed (``kind`` or ``MORIIO_COMPAT_LOOP`` = "asyncio" forces the stock loop)."""
    kind = kind or os.environ.get("MORIIO_COMPAT_LOOP", "uvloop")
    if kind == "uvloop":
        try:
            import uvloop
        except ImportError:
            return asyncio.new_event_loop()
        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        return loop
    if kind != "asyncio":
        raise ValueError(f"MORIIO_COMPAT_LOOP={kind!r}: choose 'uvloop' or 'asyncio'")
    return asyncio.new_event_loop()


class LoopThread:
    """Runs ``loop.run_forever()`` on a daemon thread named ``name``."""

    def __init__(self, name: str, kind: str | None = None) -> None:
        self.loop = new_event_loop(kind)
        self.loop.set_exception_handler(self._on_loop_error)
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), name=name, daemon=True)
        self._thread.start()
        started.wait()

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(started.set)
        self.loop.run_forever()
        # Join the loop's default executor's threads (the engine opens and closes backends there): a stopped
        # engine leaves no thread behind, and none for concurrent.futures to join at exit.
        self.loop.run_until_complete(self.loop.shutdown_default_executor())

    @staticmethod
    def _on_loop_error(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        log.error("moriio_async compat loop: %s", context.get("message"), exc_info=context.get("exception"))

    @property
    def in_loop_thread(self) -> bool:
        return threading.get_ident() == self._thread.ident

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self.loop.is_closed()

    def forbid_blocking(self, what: str) -> None:
        """Raise if the caller is the loop's own thread, where blocking on the loop would deadlock."""
        if self.in_loop_thread:
            raise RuntimeError(
                f"{what} blocks until the engine's event loop answers, and was called on that loop's own "
                "thread: it would deadlock. Call it from another thread, or use the async API "
                "(IOEngine.aio) from code running on the loop."
            )

    def run(self, coro: Coroutine[Any, Any, T], what: str, timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and block (GIL released) for its result."""
        try:
            self.forbid_blocking(what)
        except RuntimeError:
            coro.close()
            raise
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[*Ts], T], *args: *Ts) -> T:
        """Run the plain callable ``fn`` on the loop thread and return its result (directly when already there)."""
        if self.in_loop_thread:
            return fn(*args)
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def job() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:
                    future.set_exception(exc)

        self.loop.call_soon_threadsafe(job)
        return future.result()

    def post(self, fn: Callable[[*Ts], object], *args: *Ts) -> None:
        """Queue ``fn(*args)`` on the loop; calls posted from one thread run in posting order."""
        self.loop.call_soon_threadsafe(fn, *args)

    def stop(self) -> None:
        """Stop the loop and join its thread. Idempotent; from the loop thread it only asks the loop to stop."""
        if self.loop.is_closed():
            return
        if self.in_loop_thread:
            self.loop.stop()
            return
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
        self.loop.close()
