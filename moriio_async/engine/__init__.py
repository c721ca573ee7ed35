"""The engine layer: IOEngine (a facade), its configuration, sessions, peers and registered memory."""

from ..control.book import PeerInfo
from ..control.inbox import Notification
from .config import IOEngineConfig
from .engine import IOEngine
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
