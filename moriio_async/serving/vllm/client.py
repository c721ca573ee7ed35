"""The vLLM demo's load, sent with the official ``openai`` client (code nobody here wrote).

Each completion streams (``completions.create(stream=True)``) through the
proxy; the result records what :class:`..workload.Result` records for the
numpy demo: the status, the text, the time to the first token and the gaps
between tokens. The client's own retries are off (``max_retries=0``): retrying
is the proxy's job, and the figures should show it.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence

import openai

from ..workload import Result, run_each

__all__ = ["openai_load"]


async def _one(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int, index: int) -> Result:
    res = Result(index, started=time.perf_counter())
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True
        )
        async for chunk in stream:
            now = time.perf_counter()
            for choice in chunk.choices:
                res.add_text(choice.text, now)
        res.status = 200
    except openai.APIStatusError as exc:
        res.status, res.error = exc.status_code, str(exc.message)
    except openai.APIError as exc:  # a connection error, a timeout, a stream that broke off
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        res.latency = time.perf_counter() - res.started
    return res


async def openai_load(
    base_url: str,
    model: str,
    prompts: Sequence[str],
    max_tokens: int,
    concurrency: int,
    timeout: float,
    on_done: Callable[[Result], None] = lambda r: None,
) -> list[Result]:
    """Every prompt through ``base_url`` (the proxy's ``/v1``), ``concurrency`` at a time."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", timeout=timeout, max_retries=0) as client:

        def send(i: int, prompt: str) -> Awaitable[Result]:
            return _one(client, model, prompt, max_tokens, i)

        return await run_each(prompts, concurrency, send, on_done)
