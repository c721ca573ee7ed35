"""vLLM's MoRIIO connector surface on moriio_async: ``MoRIIOWrapper`` and what goes with it.

Port code written against vLLM's ``moriio_engine``/``moriio_common`` by
changing imports. ``MoRIIOWrapper`` drives a :mod:`moriio_async.compat.mori`
engine from any number of threads; ``AsyncMoRIIOWrapper`` is the same
surface over the asyncio API, for code that has a loop.

Kept from vLLM, line for line: the ``kv_connector_extra_config`` keys and
defaults, the port-offset rule (``notify_port = base + dp_rank + tp_rank``
as vLLM computes it, ``get_port_offset`` without ``tp_size``; the handshake
listener of rank (dp, tp) is at ``handshake_port + get_port_offset(dp, tp)``),
and ``TransferError``'s message::

    2/3 transfers failed:
    RDMA transfer failed: <Message()> (code=StatusCode.ERR_RDMA_OP)
    RDMA transfer timed out after 30s. Check NIC queue depth or reduce concurrency; adjust with ...

Different on purpose: ``waiting_for_transfer_complete`` blocks with the GIL
released instead of polling every millisecond, and with no list it waits for
this wrapper's own transfers that no call has waited for yet.
"""

from __future__ import annotations

from .common import (
    HandshakeError,
    MoRIIOConfig,
    MoRIIOConstants,
    MoRIIOError,
    MoRIIOMode,
    TransferError,
    get_moriio_mode,
    get_port_offset,
    merge_contiguous_blocks,
)
from .wrapper import AsyncMoRIIOWrapper, MoRIIOWrapper

__all__ = [
    "AsyncMoRIIOWrapper",
    "HandshakeError",
    "MoRIIOConfig",
    "MoRIIOConstants",
    "MoRIIOError",
    "MoRIIOMode",
    "MoRIIOWrapper",
    "TransferError",
    "get_moriio_mode",
    "get_port_offset",
    "merge_contiguous_blocks",
]
