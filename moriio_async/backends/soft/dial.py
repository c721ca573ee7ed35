"""How a software pair's two sides meet: the passive side waits by token, the active side dials.

The passive pair's endpoint carries a single-use token; its backend keeps the
pair under that token (``Expected``) until the peer's dial presents it, or the
pair closes. The active side's handshake runs on a fresh socket that must not
outlive a failure (``closed_on_failure``).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

from ...errors import ControlPlaneError

__all__ = ["Expected", "closed_on_failure"]

T = TypeVar("T")


class Expected(Generic[T]):
    """Passive pairs waiting for their peer's dial, by the token the dial will present (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_token: dict[bytes, T] = {}

    def expect(self, token: bytes, pair: T) -> None:
        with self._lock:
            self._by_token[token] = pair

    def forget(self, token: bytes) -> None:
        with self._lock:
            self._by_token.pop(token, None)

    def claim(self, token: bytes) -> T | None:
        """The pair ``token`` names, once (None: unknown, already claimed, or closed)."""
        with self._lock:
            return self._by_token.pop(token, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_token)


@contextlib.contextmanager
def closed_on_failure(sock: socket.socket, failed: str, *errors: type[Exception]) -> Iterator[None]:
    """Close ``sock`` if the block raises; ``errors`` (and OSError) become ControlPlaneError
    ("``failed``: why"), anything else propagates as it is."""
    converted: tuple[type[Exception], ...] = (OSError, *errors)
    try:
        yield
    except converted as exc:
        sock.close()
        raise ControlPlaneError(f"{failed}: {exc}") from exc
    except BaseException:
        sock.close()
        raise
