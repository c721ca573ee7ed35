"""Seams for fault injection: the places a NIC thread asks "anything to do to this request?".

A queue pair consults its ``hooks`` (``None`` by default: one attribute test
on the hot path, nothing more). Give a backend hooks with
``TcpOptions(hooks=hooks)`` (``IOEngineConfig(tcp=...)``;
``{"fault_plan": plan}`` makes ``PlanHooks`` from a plan), or set
``TcpQueuePair.hooks`` on one pair; a passive pair's hooks act on the requests
it serves. A pair with hooks sends, and is answered, one request at a time.
Hooks run on NIC threads, outside every lock, so a hook may sleep (to delay)
or block on an event (to stall) freely.

What each seam can do:

* ``on_send`` (initiator, before a request goes on the wire): return a
  ``WcStatus`` to complete the request with that status without sending it
  (in posting order; a failure puts the pair in error as a real one does), or
  ``Fault.DROP`` to cut the connection (the peer-vanished path). Sleeping
  delays this request and everything posted after it.
* ``on_response`` (initiator, a response arrived, before it completes):
  sleep to delay the completion, return a ``WcStatus`` to complete with
  instead, or ``Fault.DROP``. A pair with hooks sends one request per chunk,
  each answered on its own (no coalesced acks), so this sees each one.
* ``on_request`` (target, before serving one request): block to stall the
  peer (stop answering, socket open; the initiator sees silence), or
  ``Fault.DROP`` to close the connection.
"""

from __future__ import annotations

import enum

from ...status import WcStatus
from ...work import WorkRequest

__all__ = ["Fault", "Hooks"]


class Fault(enum.Enum):
    DROP = "drop"
    """Close the data connection now, as a crashed peer or a cut cable would."""


class Hooks:
    """No-op hooks; subclass and override what a test needs."""

    def on_send(self, qp_num: int, wr: WorkRequest) -> WcStatus | Fault | None:
        return None

    def on_response(self, qp_num: int, wr: WorkRequest, status: WcStatus) -> WcStatus | Fault | None:
        return None

    def on_request(self, qp_num: int, opcode: int, rkey: int, remote_addr: int, length: int) -> Fault | None:
        return None
