"""The proxy's view of its instances: health, incarnations, load, and the least-loaded choice.

Instances are given by URL (``http://host:port``), so the same proxy fronts a
fleet on other machines without a registry of its own. A background task polls
every instance's ``/health``; an instance is usable when it answers, has the
expected role and model fingerprint. A failure on the request path marks it
down at once; the next good health answer brings it back, with its new engine
incarnation if it restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import msgspec

from .messages import EndpointInfo, InstanceHealth

__all__ = ["Endpoint", "Fleet"]

log = logging.getLogger("moriio_async.serving")


@dataclass(eq=False)
class Endpoint:
    """One instance as the proxy sees it."""

    url: str
    role: str
    healthy: bool = False
    reason: str = "not checked yet"
    health: InstanceHealth | None = None
    in_flight: int = 0
    """Requests this proxy has outstanding on the instance (the load it balances on)."""
    served: int = 0

    def describe(self) -> EndpointInfo:
        h = self.health
        return EndpointInfo(
            url=self.url,
            role=self.role,
            healthy=self.healthy,
            reason=self.reason,
            name=h.name if h else None,
            pid=h.pid if h else None,
            incarnation=h.engine.incarnation if h else None,
            in_flight=self.in_flight,
            served=self.served,
        )


class Fleet:
    """Prefill and decode endpoints, kept fresh by polling ``/health``."""

    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        client: httpx.AsyncClient,
        fingerprint: str,
        interval: float = 0.5,
    ) -> None:
        if not prefill or not decode:
            raise ValueError("a fleet needs at least one prefill and one decode instance")
        self.endpoints = [Endpoint(u.rstrip("/"), "prefill") for u in prefill]
        self.endpoints += [Endpoint(u.rstrip("/"), "decode") for u in decode]
        self.client, self.fingerprint, self.interval = client, fingerprint, interval
        self._turn = itertools.count()
        self._task: asyncio.Task[None] | None = None
        self._decoder = msgspec.json.Decoder(InstanceHealth)

    def of(self, role: str) -> list[Endpoint]:
        return [e for e in self.endpoints if e.role == role]

    async def start(self) -> None:
        await self.check_all()
        self._task = asyncio.create_task(self._poll(), name="fleet health")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.check_all()

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(e) for e in self.endpoints))

    async def check(self, ep: Endpoint) -> None:
        try:
            resp = await self.client.get(f"{ep.url}/health", timeout=max(1.0, self.interval * 2))
            resp.raise_for_status()
            health = self._decoder.decode(resp.content)
        except (httpx.HTTPError, msgspec.DecodeError) as exc:
            self.mark_down(ep, f"health check failed: {type(exc).__name__}: {exc}")
            return
        if health.role != ep.role or health.fingerprint != self.fingerprint:
            self.mark_down(ep, f"it serves {health.role} of model {health.model} ({health.fingerprint})")
            return
        old = ep.health
        if old is not None and old.engine.incarnation != health.engine.incarnation:
            log.warning("%s %s restarted: incarnation %#x", ep.role, ep.url, health.engine.incarnation)
        if not ep.healthy:
            log.info("%s %s is up (%s)", ep.role, ep.url, health.name)
        ep.health, ep.healthy, ep.reason = health, True, "ok"

    def mark_down(self, ep: Endpoint, reason: str) -> None:
        if ep.healthy:
            log.warning("%s %s is down: %s", ep.role, ep.url, reason)
        ep.healthy, ep.reason = False, reason

    def pick(self, role: str, exclude: set[Endpoint]) -> Endpoint | None:
        """The healthy endpoint with the fewest requests in flight; ties go round-robin."""
        usable = [e for e in self.of(role) if e.healthy and e.health is not None and e not in exclude]
        if not usable:
            return None
        turn = next(self._turn)
        n = len(self.endpoints)
        return min(usable, key=lambda e: (e.in_flight, (self.endpoints.index(e) - turn) % n))

    @contextlib.contextmanager
    def using(self, ep: Endpoint) -> Iterator[None]:
        """Count a request on ``ep`` for the body; a success counts as served."""
        ep.in_flight += 1
        try:
            yield
            ep.served += 1
        finally:
            ep.in_flight -= 1

    def ready(self) -> bool:
        return all(any(e.healthy for e in self.of(role)) for role in ("prefill", "decode"))
