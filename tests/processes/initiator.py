"""An initiator engine in its own process without CAP_SYS_PTRACE (``backend="auto"``).

``python tests/processes/initiator.py ADDRESS NAME SIZE SEED`` connects to the target at ADDRESS, reads
its region NAME (SIZE bytes, filled from SEED), checks it, writes it back inverted, and prints one JSON
line: the session's transport and whether the read matched. Log records go to stderr as
``LEVEL logger message``, one a line. Root would attach to anything; dropping CAP_SYS_PTRACE lets an
undumpable target refuse it, as another user's process would. Run with the repository on PYTHONPATH.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys

import numpy as np

from moriio_async import IOEngine, IOEngineConfig, waiting_for_transfer_complete
from tests.backends.cma_peer import drop_cap_sys_ptrace


async def main(address: str, name: str, size: int, seed: int) -> None:
    local = np.zeros(size, np.uint8)
    async with IOEngine("init", IOEngineConfig(backend="auto")) as engine:
        desc = engine.register_memory(local)
        peer = await engine.connect(address)
        session = await engine.create_session(desc, peer.memory[name])
        await waiting_for_transfer_complete([session.read(0, 0, size)], timeout=30)
        matched = bool(np.array_equal(local, np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)))
        np.bitwise_not(local, out=local)
        await waiting_for_transfer_complete([session.write(0, 0, size)], timeout=30)
        print(json.dumps({"transport": session.transport, "matched": matched, "repr": repr(session)}), flush=True)


if __name__ == "__main__":
    drop_cap_sys_ptrace()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
