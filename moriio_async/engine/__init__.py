"""The engine layer: IOEngine, its configuration, sessions and registered memory."""

from .config import IOEngineConfig
from .engine import IOEngine, Notification, PeerInfo
from .session import Session

__all__ = ["IOEngine", "IOEngineConfig", "Notification", "PeerInfo", "Session"]
