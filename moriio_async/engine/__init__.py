"""The engine layer: IOEngine (a facade), its configuration, sessions, peers and registered memory."""

from .book import PeerInfo
from .config import IOEngineConfig
from .engine import IOEngine
from .inbox import Notification
from .session import Session
from .statistics import EngineStatistics, InboundStatistics, SessionStatistics

__all__ = [
    "EngineStatistics",
    "IOEngine",
    "IOEngineConfig",
    "InboundStatistics",
    "Notification",
    "PeerInfo",
    "Session",
    "SessionStatistics",
]
