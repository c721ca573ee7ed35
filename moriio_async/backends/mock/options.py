"""``MockOptions``: what only the mock backend reads (``IOEngineConfig(mock=MockOptions(...))``)."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import InvalidArgument
from .fabric import MockFabric

__all__ = ["MockOptions"]


@dataclass(frozen=True, slots=True)
class MockOptions:
    """The mock backend's own settings."""

    hold: bool = False
    """The NIC runs a request only when the test says so (``MockQueuePair.step``, ``fail_next``, ``vanish``)."""
    silent_cq: bool = False
    """Completion queues raise no wakeup (the engine must ``drain_completions``)."""
    fabric: MockFabric | None = None
    """The group of engines that can reach each other; None: the process-wide default one."""

    def __post_init__(self) -> None:
        for name in ("hold", "silent_cq"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgument(f"MockOptions.{name} must be a bool, not {getattr(self, name)!r}")
        if self.fabric is not None and not isinstance(self.fabric, MockFabric):
            raise InvalidArgument(f"MockOptions.fabric must be a MockFabric, not {type(self.fabric).__name__}")
