"""The demo's client side: seeded prompts, concurrent streamed completions, and what they measured.

Each request streams through the proxy (server-sent events, as an OpenAI client
does); the client notes the time to the first token, every gap between tokens,
and the ``kv_transfer`` field of the last chunk.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import httpx
import msgspec

from .api import JsonValue
from .messages import KvTransfer

__all__ = ["Result", "make_prompts", "percentile", "run_each", "run_load", "stream_completion"]

# fmt: off
_WORDS = (
    "the", "a", "prefill", "decode", "cache", "block", "layer", "token", "attention", "transfer", "queue",
    "pair", "engine", "memory", "region", "session", "batch", "read", "write", "release", "notify",
    "incarnation", "deadline", "model", "server", "proxy", "request", "stream", "latency", "bandwidth",
    "loopback", "socket", "kernel", "completion", "channel", "event", "loop", "await", "future", "task",
    "worker",
)
# fmt: on


def make_prompts(n: int, seed: int, min_bytes: int, max_bytes: int) -> list[str]:
    """``n`` prompts of seeded random words, each ``min_bytes..max_bytes`` long."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        target = rng.randint(min_bytes, max_bytes)
        words = [f"Request {i}:"]
        while sum(len(w) + 1 for w in words) < target:
            words.append(rng.choice(_WORDS))
        prompts.append(" ".join(words)[:target])
    return prompts


@dataclass
class Result:
    """One request as the client saw it."""

    index: int
    status: int = 0
    text: str = ""
    error: str = ""
    started: float = 0.0
    latency: float = 0.0
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    kv: KvTransfer = field(default_factory=KvTransfer)
    """The proxy's ``kv_transfer`` (its defaults where the proxy sent none: a vLLM proxy's)."""
    _last: float = field(default=0.0, init=False, repr=False, compare=False)  # when add_text last took a piece

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    def add_text(self, text: str, now: float) -> None:
        """A streamed piece of the completion arrived at ``now`` (``perf_counter``): the first one sets
        ``ttft``, each later one adds its gap since the one before. Empty pieces are no tokens."""
        if not text:
            return
        if self.ttft is None:
            self.ttft = now - self.started
        else:
            self.gaps.append(now - self._last)
        self._last = now
        self.text += text


async def stream_completion(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: str,
    max_tokens: int,
    index: int,
    timeout: float,
    extra: Mapping[str, JsonValue] | None = None,
) -> Result:
    """One streamed completion (``extra``: more body fields); never raises (the result says what went wrong)."""
    res = Result(index, started=time.perf_counter())
    body = {**(extra or {}), "model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                res.error = (await resp.aread()).decode(errors="replace")
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    res.error = event["error"]["message"]
                    break
                now = time.perf_counter()
                for choice in event.get("choices", []):
                    res.add_text(choice["text"], now)
                if "kv_transfer" in event:
                    res.kv = msgspec.convert(event["kv_transfer"], KvTransfer)
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        res.latency = time.perf_counter() - res.started
    return res


async def run_load(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompts: Sequence[str],
    max_tokens: int,
    concurrency: int,
    timeout: float,
    on_done: Callable[[Result], None] = lambda r: None,
    first_index: int = 0,
    extra: Mapping[str, JsonValue] | None = None,
) -> list[Result]:
    """Every prompt through the proxy, ``concurrency`` at a time."""

    def send(i: int, prompt: str) -> Awaitable[Result]:
        return stream_completion(client, url, model, prompt, max_tokens, first_index + i, timeout, extra)

    return await run_each(prompts, concurrency, send, on_done)


async def run_each(
    prompts: Sequence[str],
    concurrency: int,
    send: Callable[[int, str], Awaitable[Result]],
    on_done: Callable[[Result], None],
) -> list[Result]:
    """``send(i, prompts[i])`` for every prompt, ``concurrency`` at a time; ``on_done`` sees each result as it
    comes, the list has them in the prompts' order."""
    limit = asyncio.Semaphore(concurrency)

    async def one(i: int, prompt: str) -> Result:
        async with limit:
            res = await send(i, prompt)
        on_done(res)
        return res

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) by nearest rank; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else 0.0
