"""The mock's fabric: how mock queue pairs in one process find each other.

An endpoint crosses the engines' control plane as JSON, so the active pair can
only name its peer by a token; something both backends share must map the
token to the passive pair. That is a ``MockFabric``. Give backends one with
``MockOptions(fabric=fabric)`` to keep them apart from every
other mock in the process; backends opened without one join the process's
default fabric, so two engines configured independently (as users and most
tests do) still reach each other.
"""

from __future__ import annotations

import itertools
import threading
from typing import ClassVar

__all__ = ["MockFabric"]


class MockFabric:
    """Passive pairs by token (each good for one connect) and queue-pair numbers."""

    _default: ClassVar[MockFabric | None] = None
    _default_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[str, object] = {}
        self._numbers = itertools.count(0x100)

    @classmethod
    def default(cls) -> MockFabric:
        """The process's default fabric, made on first use."""
        with cls._default_lock:
            if cls._default is None:
                cls._default = MockFabric()
            return cls._default

    def next_qp_num(self) -> int:
        with self._lock:
            return next(self._numbers) & 0xFFFFFF

    def listen(self, token: str, pair: object) -> None:
        with self._lock:
            self._waiting[token] = pair

    def claim(self, token: str) -> object | None:
        """The passive pair ``token`` names, once."""
        with self._lock:
            return self._waiting.pop(token, None)

    def forget(self, token: str) -> None:
        with self._lock:
            self._waiting.pop(token, None)
