"""vLLM's MoRIIO values: errors, constants, ``kv_connector_extra_config`` parsing, port offsets,
``merge_contiguous_blocks`` and the lines of ``TransferError``."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..mori import StatusCode

__all__ = [
    "HandshakeError",
    "MoRIIOConfig",
    "MoRIIOConstants",
    "MoRIIOError",
    "MoRIIOMode",
    "TransferError",
    "failed_line",
    "get_moriio_mode",
    "get_port_offset",
    "merge_contiguous_blocks",
    "timed_out_line",
    "transfer_error",
]


class MoRIIOError(Exception):
    """Base exception for MoRIIO operations."""


class HandshakeError(MoRIIOError):
    """Exception raised when handshake fails."""


class TransferError(MoRIIOError):
    """Exception raised when transfer fails: "k/n transfers failed:" then one line per transfer."""


class MoRIIOConstants:
    """vLLM's constants for the MoRIIO connector."""

    GET_META_MSG = b"get_meta_msg"
    POP_DONE_RECV = b"pop_done_recv"
    OVER = b"OVER"
    COMPLETION_PREFIX = "cmpl"
    TRANSFER_PREFIX = "tx"
    PING_INTERVAL = 3
    MAX_PING_RETRIES = 100
    DEFAULT_HANDSHAKE_PORT = "6301"
    DEFAULT_NOTIFY_PORT = "61005"
    VLLM_MORI_READ_ABORT_REQUEST_TIMEOUT = 3600
    DEFAULT_TRANSFER_TIMEOUT = 30.0
    DEFAULT_DEFER_TIMEOUT = 60.0


class MoRIIOMode(enum.Enum):
    READ = "read"
    WRITE = "write"


def get_moriio_mode(extra_config: Mapping[str, Any]) -> MoRIIOMode:
    """READ when ``read_mode`` is "true" or "1" (decode pulls); WRITE otherwise (prefill pushes)."""
    read = str(extra_config.get("read_mode", "false")).lower().strip() in ("true", "1")
    return MoRIIOMode.READ if read else MoRIIOMode.WRITE


def get_port_offset(dp_rank: int, tp_rank: int, tp_size: int = 1) -> int:
    return dp_rank * tp_size + tp_rank


@dataclass
class MoRIIOConfig:
    """The connector's settings from ``kv_connector_extra_config``, with vLLM's defaults."""

    local_ip: str
    handshake_port: int
    notify_port: int
    tp_rank: int
    dp_rank: int
    dp_size: int
    tp_size: int
    transfer_timeout: float
    defer_timeout: float
    read_mode: bool = False
    qp_per_transfer: int = 1
    post_batch_size: int = -1
    num_workers: int = 1
    backend: str = "rdma"
    proxy_ip: str | None = None
    proxy_ping_port: int | None = None
    http_port: int | None = None

    @classmethod
    def from_extra_config(
        cls,
        extra_config: Mapping[str, Any],
        *,
        tp_rank: int = 0,
        dp_rank: int = 0,
        tp_size: int = 1,
        dp_size: int = 1,
    ) -> MoRIIOConfig:
        """vLLM's ``from_vllm_config`` minus vLLM: ``notify_port`` is this rank's (base + offset).

        The proxy keys (``proxy_ip``, ``proxy_ping_port``, ``http_port``), required by
        vLLM's service discovery, are optional here.
        """
        extra = dict(extra_config)
        for key, default in (
            ("handshake_port", MoRIIOConstants.DEFAULT_HANDSHAKE_PORT),
            ("notify_port", MoRIIOConstants.DEFAULT_NOTIFY_PORT),
        ):
            if not extra.get(key):
                extra[key] = default
        backend = str(extra.get("backend", "rdma")).lower()
        if backend not in ("rdma", "xgmi"):
            raise ValueError(
                f"Invalid MoRIIO backend {backend!r} in kv_connector_extra_config; must be one of 'rdma' or 'xgmi'."
            )

        def optional_int(key: str) -> int | None:
            return None if extra.get(key) is None else int(extra[key])

        return cls(
            local_ip=str(extra.get("host_ip") or "127.0.0.1"),
            handshake_port=int(extra["handshake_port"]),
            notify_port=int(extra["notify_port"]) + get_port_offset(dp_rank, tp_rank),
            tp_rank=tp_rank,
            dp_rank=dp_rank,
            dp_size=dp_size,
            tp_size=tp_size,
            transfer_timeout=float(extra.get("transfer_timeout", MoRIIOConstants.DEFAULT_TRANSFER_TIMEOUT)),
            defer_timeout=float(extra.get("defer_timeout", MoRIIOConstants.DEFAULT_DEFER_TIMEOUT)),
            read_mode=get_moriio_mode(extra) is MoRIIOMode.READ,
            qp_per_transfer=int(extra.get("qp_per_transfer", 1)),
            post_batch_size=int(extra.get("post_batch_size", -1)),
            num_workers=int(extra.get("num_workers", 1)),
            backend=backend,
            proxy_ip=None if extra.get("proxy_ip") is None else str(extra["proxy_ip"]),
            proxy_ping_port=optional_int("proxy_ping_port"),
            http_port=optional_int("http_port"),
        )

    def handshake_port_for(self, dp_rank: int, tp_rank: int | None = None) -> int:
        """Where rank (dp_rank, tp_rank)'s handshake listener is: base + get_port_offset(dp, tp)."""
        return self.handshake_port + get_port_offset(dp_rank, self.tp_rank if tp_rank is None else tp_rank)


def merge_contiguous_blocks(
    offsets_local: Sequence[int],
    offsets_remote: Sequence[int],
    sizes: Sequence[int],
    assume_sorted: bool = False,
) -> tuple[list[int], list[int], list[int]]:
    """Sort by local offset (stable); neighbours merge when both gaps equal the first one's size."""
    n = len(offsets_local)
    if n == 0:
        return [], [], []
    if not n == len(offsets_remote) == len(sizes):
        raise ValueError("Input list lengths mismatch")
    lo, ro, sz = [int(v) for v in offsets_local], [int(v) for v in offsets_remote], [int(v) for v in sizes]
    if not assume_sorted and any(lo[i] > lo[i + 1] for i in range(n - 1)):
        order = sorted(range(n), key=lo.__getitem__)
        lo, ro, sz = [lo[i] for i in order], [ro[i] for i in order], [sz[i] for i in order]
    out_lo, out_ro, out_sz = [lo[0]], [ro[0]], [sz[0]]
    for i in range(1, n):
        if lo[i] - lo[i - 1] == sz[i - 1] and ro[i] - ro[i - 1] == sz[i - 1]:
            out_sz[-1] = lo[i] + sz[i] - out_lo[-1]
        else:
            out_lo.append(lo[i])
            out_ro.append(ro[i])
            out_sz.append(sz[i])
    return out_lo, out_ro, out_sz


def failed_line(message: str, code: int) -> str:
    return f"RDMA transfer failed: {message} (code={StatusCode(code)})"


def timed_out_line(timeout: float) -> str:
    return (
        f"RDMA transfer timed out after {timeout:.0f}s. "
        f"Check NIC queue depth or reduce concurrency; "
        f"adjust with kv_connector_extra_config.transfer_timeout."
    )


def transfer_error(lines: list[str], total: int) -> TransferError:
    return TransferError(f"{len(lines)}/{total} transfers failed:\n" + "\n".join(lines))
