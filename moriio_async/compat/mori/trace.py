"""An opt-in record of every transfer a compat engine ran: one JSON line per ended status.

Set ``MORIIO_ASYNC_TRACE=DIR`` in a process's environment and each compat
engine it builds appends to ``DIR/<pid>-<n>.jsonl`` one line per status that was
posted, when the status ends::

    {"engine": "producer:...", "op": "write", "bytes": 262144, "code": 0,
     "t0": 1234.5678, "t1": 1234.5691, "transport": "cma"}

``t0`` is when the caller's ``read``/``write``/``batch_*`` call began and
``t1`` when the last of its parts ended, both ``time.monotonic()`` (one clock
for every process on a host). It is how the vLLM demo measures KV transfer
time and bytes inside servers it did not write. Lines are written from the
engine's loop thread, line-buffered (a ``write`` system call per status), so
leave it off where that matters.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
from pathlib import Path
from typing import TextIO

__all__ = ["TRACE_ENV", "TransferTrace"]

TRACE_ENV = "MORIIO_ASYNC_TRACE"
_numbers = itertools.count()


class TransferTrace:
    """One engine's trace file (append-only; closed with the engine)."""

    def __init__(self, path: Path, engine: str) -> None:
        self.path = path
        self.engine = engine
        self._lock = threading.Lock()
        self._file: TextIO | None = path.open("a", buffering=1, encoding="utf-8")

    @classmethod
    def from_env(cls, engine: str) -> TransferTrace | None:
        folder = os.environ.get(TRACE_ENV)
        if not folder:
            return None
        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        return cls(path / f"{os.getpid()}-{next(_numbers)}.jsonl", engine)

    def record(self, *, op: str, nbytes: int, code: int, t0: float, t1: float, transport: str) -> None:
        line = json.dumps(
            {"engine": self.engine, "op": op, "bytes": nbytes, "code": code, "t0": t0, "t1": t1, "transport": transport}
        )
        with self._lock:
            if self._file is not None:
                self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
