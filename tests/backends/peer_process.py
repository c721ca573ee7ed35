"""A passive target in its own process, for tests that kill their peer.

Run as ``python -m tests.backends.peer_process NAME OPTIONS_JSON SIZE`` from the
repository root. It reads the active pair's endpoint (one JSON line on stdin),
connects, and answers one JSON line: its endpoint and its region (addr, rkey,
length). Then it serves until stdin closes (or it is killed).
"""

from __future__ import annotations

import json
import sys

import numpy as np

from moriio_async.backends import open_backend
from moriio_async.backends.base import BackendOptions
from moriio_async.backends.options import VerbsOptions
from moriio_async.status import Access


def main() -> None:
    name, options, size = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    verbs = options.pop("verbs", None)
    backend = open_backend(name, BackendOptions(**options, specific=VerbsOptions(**verbs) if verbs else None))
    cq = backend.create_cq(1024)
    qp = backend.create_qp(cq)
    buf = np.zeros(size, np.uint8)
    mr = backend.register_memory(memoryview(buf), Access.all())
    backend.export_memory(mr)
    qp.connect(json.loads(sys.stdin.readline()))
    reply = {"endpoint": dict(qp.endpoint()), "addr": mr.addr, "rkey": mr.rkey, "length": mr.length}
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()
    sys.stdin.readline()
    qp.close()
    cq.close()
    backend.deregister_memory(mr)
    backend.close()


if __name__ == "__main__":
    main()
