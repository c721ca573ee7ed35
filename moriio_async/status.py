"""Status codes: MoRI-IO's transfer codes and the verbs work-completion statuses.

Both enums keep the numeric values of the systems they mirror, so a number in
a log line means the same thing here as in MoRI-IO or in ``ibv_wc_status``.
"""

from __future__ import annotations

import enum

__all__ = ["Access", "Opcode", "StatusCode", "WcStatus"]


class StatusCode(enum.IntEnum):
    """A transfer's state, with MoRI-IO's values (``Failed()`` means code > 10)."""

    SUCCESS = 0
    INIT = 1
    IN_PROGRESS = 2
    ERR_INVALID_ARGS = 11
    ERR_NOT_FOUND = 12
    ERR_RDMA_OP = 13
    ERR_BAD_STATE = 14
    ERR_GPU_OP = 15


class WcStatus(enum.IntEnum):
    """A work completion's status, with ``enum ibv_wc_status``'s values."""

    SUCCESS = 0
    LOC_LEN_ERR = 1
    LOC_QP_OP_ERR = 2
    LOC_EEC_OP_ERR = 3
    LOC_PROT_ERR = 4
    WR_FLUSH_ERR = 5
    MW_BIND_ERR = 6
    BAD_RESP_ERR = 7
    LOC_ACCESS_ERR = 8
    REM_INV_REQ_ERR = 9
    REM_ACCESS_ERR = 10
    REM_OP_ERR = 11
    RETRY_EXC_ERR = 12
    RNR_RETRY_EXC_ERR = 13
    LOC_RDD_VIOL_ERR = 14
    REM_INV_RD_REQ_ERR = 15
    REM_ABORT_ERR = 16
    INV_EECN_ERR = 17
    INV_EEC_STATE_ERR = 18
    FATAL_ERR = 19
    RESP_TIMEOUT_ERR = 20
    GENERAL_ERR = 21

    @classmethod
    def parse(cls, value: int) -> WcStatus:
        """Map a raw status to the enum; an unknown number becomes GENERAL_ERR."""
        try:
            return cls(value)
        except ValueError:
            return cls.GENERAL_ERR


class Opcode(enum.IntEnum):
    """The one-sided operations a work request can carry."""

    RDMA_WRITE = 0
    RDMA_READ = 4  # IBV_WR_RDMA_READ


class Access(enum.IntFlag):
    """Memory-region access rights, with ``enum ibv_access_flags``'s bits."""

    LOCAL_WRITE = 1
    REMOTE_WRITE = 2
    REMOTE_READ = 4

    @classmethod
    def all(cls) -> Access:
        return cls.LOCAL_WRITE | cls.REMOTE_WRITE | cls.REMOTE_READ
