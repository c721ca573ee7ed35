"""The README's transfer example, run as written: if the API it shows changes, this fails.

The only edit is the prefill side's port (5555 in the text), swapped for a free one so parallel
runs cannot collide.
"""

from __future__ import annotations

import asyncio
import re
import socket
from pathlib import Path
from typing import Any

import numpy as np

README = Path(__file__).resolve().parents[2] / "README.md"


def _example(port: int) -> dict[str, Any]:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README.md has no python example"
    code = blocks[0]
    assert "port=5555" in code, "the example's listening port moved: update this test"
    namespace: dict[str, Any] = {}
    exec(compile(code.replace("port=5555", f"port={port}"), str(README), "exec"), namespace)
    return namespace


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _listening(port: int) -> None:
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.05)
            continue
        writer.close()
        await writer.wait_closed()
        return


async def test_readme_example_reads_the_prefill_cache_and_notifies(capsys: Any) -> None:
    port = _free_port()
    example = _example(port)
    cache = (np.arange(4 << 20, dtype=np.uint64) % 251).astype(np.uint8)
    landed = np.zeros_like(cache)
    prefill = asyncio.create_task(example["prefill_side"](cache))
    listening = asyncio.create_task(_listening(port))
    done, _ = await asyncio.wait({prefill, listening}, timeout=20, return_when=asyncio.FIRST_COMPLETED)
    if prefill in done:
        listening.cancel()
        prefill.result()  # whatever ended the prefill side before it listened
        raise AssertionError("the prefill side returned before anyone connected")
    if listening not in done:
        listening.cancel()
        prefill.cancel()
        raise AssertionError(f"the prefill side did not listen on port {port} within 20 s")
    await asyncio.wait_for(example["decode_side"](f"127.0.0.1:{port}", landed), 30)
    await asyncio.wait_for(prefill, 10)  # it returns once the notification arrived
    assert np.array_equal(landed, cache)
    assert "failed" not in capsys.readouterr().out  # the except branch never ran
