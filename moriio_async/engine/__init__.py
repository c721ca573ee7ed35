"""The engine layer: IOEngine (a facade), its configuration, sessions, peers and registered memory."""

from .book import PeerInfo
from .config import IOEngineConfig
from .engine import IOEngine
from .inbox import Notification
from .session import Session

__all__ = ["IOEngine", "IOEngineConfig", "Notification", "PeerInfo", "Session"]
