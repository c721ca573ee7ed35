"""A peer process for the failure tests: one verbs queue pair and one region, then it waits to be killed.

stdin: one JSON line, the active side's endpoint. stdout: one JSON line with
this side's endpoint and its region (addr, rkey, length). Then it sleeps.
"""

from __future__ import annotations

import json
import os
import sys
import time

from moriio_async.backends import open_backend
from moriio_async.backends.base import BackendOptions
from moriio_async.backends.verbs import VerbsOptions
from moriio_async.status import Access


def main() -> None:
    options = BackendOptions(specific=VerbsOptions(device=os.environ.get("MORIIO_GUEST_DEVICE", "rxe0")))
    backend = open_backend("verbs", options)
    size = int(os.environ.get("PEER_REGION_BYTES", str(8 << 20)))
    buffer = bytearray(size)
    region = backend.register_memory(memoryview(buffer), Access.all())
    cq = backend.create_cq(64)
    qp = backend.create_qp(cq)
    remote = json.loads(sys.stdin.readline())
    qp.connect(remote)
    reply = {"endpoint": dict(qp.endpoint()), "addr": region.addr, "rkey": region.rkey, "length": region.length}
    print(json.dumps(reply), flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main()
