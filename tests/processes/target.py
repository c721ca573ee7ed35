"""A target engine in its own process, driven by JSON lines on stdin (one reply line each).

Commands: {"cmd": "register", "name", "size", "seed"} -> desc; {"cmd": "deregister", "name"};
{"cmd": "digest", "name"} -> sha256 of the region; {"cmd": "block", "seconds"} blocks the event
loop (the NIC must keep serving); {"cmd": "inbound", "peer", "uid", "timeout"} -> the code the
peer's transfer uid ended with (null if none within the timeout); {"cmd": "stats"} -> statistics();
{"cmd": "exit"}. With ``$MORIIO_TEST_UNDUMPABLE`` set it first makes itself undumpable, so a peer
without CAP_SYS_PTRACE may not attach to it (the kernel refuses cma).
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import json
import os
import sys
import time

import numpy as np

from moriio_async import IOEngine, IOEngineConfig


async def main(backend: str) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    buffers: dict[str, np.ndarray] = {}
    descs = {}

    def reply(obj: object) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    async with IOEngine("target", IOEngineConfig(backend=backend)) as engine:
        reply({"address": engine.address})
        while line := await reader.readline():
            msg = json.loads(line)
            cmd = msg["cmd"]
            if cmd == "register":
                buf = np.random.default_rng(msg["seed"]).integers(0, 256, msg["size"], dtype=np.uint8)
                buffers[msg["name"]] = buf
                descs[msg["name"]] = engine.register_memory(buf, name=msg["name"])
                reply({"ok": True})
            elif cmd == "deregister":
                engine.deregister_memory(descs.pop(msg["name"]))
                reply({"ok": True})
            elif cmd == "digest":
                reply({"sha256": hashlib.sha256(buffers[msg["name"]]).hexdigest()})
            elif cmd == "block":
                time.sleep(msg["seconds"])  # noqa: ASYNC251 - the event loop is blocked on purpose
                reply({"ok": True})
            elif cmd == "inbound":
                try:
                    code = await engine.wait_inbound_transfer_status(msg["peer"], msg["uid"], msg["timeout"])
                    reply({"code": int(code)})
                except TimeoutError:
                    reply({"code": None})
            elif cmd == "stats":
                reply(engine.statistics().figures())
            elif cmd == "exit":
                reply({"ok": True})
                return


if __name__ == "__main__":
    undumpable = os.environ.get("MORIIO_TEST_UNDUMPABLE")
    if undumpable and ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE, 0
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE)")
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "tcp"))
