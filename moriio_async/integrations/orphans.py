"""Decode-side blocks of WRITE-mode requests that ended before their KV arrived: given back after a grace period.

In WRITE mode the prefill server writes a request's KV into blocks the decode
server allocated, and tells it when done. vLLM's scheduler, when such a
request ends first (the client or the proxy gave up: typically because the
prefill server died), keeps the request's blocks until the connector reports
the receive finished, so that a late write cannot land in blocks given to
another request. vLLM 0.32's MoRIIO connector never reports it: it forgets
the request's transfer id as the request ends, and a late "written" notice
is then dropped, so the blocks stay taken for good (and the engine keeps
stepping for them). With a dead prefill server, no notice comes at all.

:class:`WriteWaits`, wrapped around the scheduler side of the consumer's
connector, remembers which requests wait for a WRITE; when one ends still
waiting, it reports the receive finished ``grace`` seconds later (the
connector's ``recv_abort_timeout``, the time vLLM already allows a receive
before it gives up on one). The scheduler then frees the blocks. The grace is
what keeps a slow but living prefill server's write out of reused blocks: a
prefill server frozen for longer than that which then resumes writing is the
one case it cannot cover (nothing on the decode side can revoke a write
already granted to a peer's memory region), as with vLLM's own
``recv_abort_timeout`` on reads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["WriteWaits"]

log = logging.getLogger("moriio_async")


class WriteWaits:
    """Requests waiting for a remote WRITE (request id -> nothing) and ended ones (request id -> when to free)."""

    def __init__(self, grace: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.grace, self.clock = grace, clock
        self.waiting: set[str] = set()
        self.orphans: dict[str, float] = {}

    def expect(self, request_id: str) -> None:
        self.waiting.add(request_id)

    def ended(self, request_id: str) -> None:
        """The request ended; if its KV had not arrived, its blocks go back after the grace."""
        if request_id in self.waiting:
            self.waiting.discard(request_id)
            self.orphans[request_id] = self.clock() + self.grace

    def arrived(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.waiting.discard(rid)
            self.orphans.pop(rid, None)

    def due(self) -> set[str]:
        """Ended requests whose grace is over (each returned once)."""
        now = self.clock()
        done = {rid for rid, at in self.orphans.items() if at <= now}
        for rid in done:
            del self.orphans[rid]
        return done

    def install(self, scheduler: Any) -> bool:
        """Wrap a consumer's MoRIIO scheduler (``MoRIIOConnectorScheduler``); False when its names are unknown."""
        names = ("update_state_after_alloc", "request_finished", "update_connector_output")
        if not all(callable(getattr(scheduler, n, None)) for n in names):
            log.info("vLLM's MoRIIO scheduler lacks %s: blocks of abandoned WRITEs are vLLM's matter", names)
            return False
        alloc, finished, update = (getattr(scheduler, n) for n in names)

        def update_state_after_alloc(request: Any, blocks: Any, num_external_tokens: int, *rest: Any) -> Any:
            params = request.kv_transfer_params or {}
            writes = bool(params.get("do_remote_prefill")) and num_external_tokens > 0  # before vLLM clears it
            result = alloc(request, blocks, num_external_tokens, *rest)
            if writes:
                self.expect(request.request_id)
            return result

        def request_finished(request: Any, *args: Any, **kwargs: Any) -> Any:
            result = finished(request, *args, **kwargs)
            self.ended(request.request_id)
            return result

        def update_connector_output(output: Any) -> None:
            self.arrived(output.finished_recving or ())
            update(output)
            due = self.due()
            if due:
                log.warning("%d decode request(s) ended before their KV was written; their blocks go back after "
                            "%.0fs: %s", len(due), self.grace, ", ".join(sorted(due)))  # fmt: skip
                output.finished_recving = set(output.finished_recving or ()) | due

        scheduler.update_state_after_alloc = update_state_after_alloc
        scheduler.request_finished = request_finished
        scheduler.update_connector_output = update_connector_output
        return True
