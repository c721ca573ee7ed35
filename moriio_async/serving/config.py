"""Settings of the serving processes, and the command-line flags that build them.

Every process of a fleet is given the same model flags; the model's fingerprint
(weights seed and cache layout) is checked by the proxy, so an instance started
with other flags is never paired with the rest.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Literal

from .messages import Mode
from .model import ModelConfig

__all__ = ["InstanceSettings", "ProxySettings", "Role", "add_model_args", "add_timeout_args", "model_config"]

Role = Literal["prefill", "decode"]


@dataclass(frozen=True, slots=True)
class InstanceSettings:
    """One prefill or decode instance: its model, its KV pool, its engine and its deadlines."""

    name: str
    """Engine key, unique in the fleet (``prefill-0``); a restarted instance keeps it."""
    role: Role
    model: ModelConfig
    num_blocks: int
    backend: str = "auto"
    """Each session uses the best transport both instances share: cma on one host, else verbs, else tcp."""
    host: str = "127.0.0.1"
    engine_port: int = 0
    transfer_timeout: float = 30.0
    """vLLM's transfer_timeout: the deadline of every wait for KV transfers."""
    control_timeout: float = 5.0
    """Deadline of a control exchange (connect, notify, prefill and decode meeting on a request)."""
    admission_timeout: float = 10.0
    """How long a request waits for free KV blocks before a retryable 503."""

    def __post_init__(self) -> None:
        if self.num_blocks < self.model.blocks_for(self.model.max_model_len):
            raise ValueError(
                f"{self.num_blocks} KV blocks cannot hold one max_model_len sequence "
                f"({self.model.blocks_for(self.model.max_model_len)} blocks)"
            )
        for name in ("transfer_timeout", "control_timeout", "admission_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")

    @property
    def lease_timeout(self) -> float:
        """READ mode: how long prefill keeps blocks lent to a decode instance that never releases them.

        Longer than any reader can take (its transfer deadline, then an abort), so a
        lease only expires for a reader that died or lost its way.
        """
        return 2 * self.transfer_timeout + 2 * self.control_timeout

    @property
    def write_wait_timeout(self) -> float:
        """WRITE mode: how long decode waits for write_done/write_failed before asking if prefill is alive."""
        return self.admission_timeout + self.transfer_timeout + 2 * self.control_timeout


@dataclass(frozen=True, slots=True)
class ProxySettings:
    """The proxy's instances, the model they must all serve, and its deadlines (seconds)."""

    prefill: list[str]
    decode: list[str]
    """The instances' base URLs, by role."""
    model: ModelConfig
    """The model every instance must serve: one whose health reports another fingerprint is not used."""
    mode: Mode = "write"
    """How the KV cache travels: prefill WRITEs it into decode's blocks, or decode READs it from prefill's."""
    transfer_timeout: float = 30.0
    control_timeout: float = 5.0
    admission_timeout: float = 10.0
    """The instances' own deadlines (the same flags): the proxy bounds each leg by them (``leg_timeout``)."""
    max_attempts: int = 3
    """Tries of one request, the first included; after a retryable failure, the instance blamed is left out."""
    health_interval: float = 0.5
    """Seconds between two rounds of health probes of the instances."""

    @property
    def leg_timeout(self) -> float:
        """Longest an instance may take to answer a leg (its own deadlines, all of them, plus margin)."""
        return 2 * (self.admission_timeout + self.transfer_timeout) + 6 * self.control_timeout


def add_model_args(parser: argparse.ArgumentParser, small: ModelConfig | None = None) -> None:
    d = small or ModelConfig()
    g = parser.add_argument_group("model (every process of a fleet needs the same values)")
    g.add_argument("--model-name", default=d.name)
    g.add_argument("--d-model", type=int, default=d.d_model)
    g.add_argument("--layers", type=int, default=d.n_layers)
    g.add_argument("--heads", type=int, default=d.n_heads)
    g.add_argument("--d-ff", type=int, default=d.d_ff)
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    g.add_argument("--max-model-len", type=int, default=d.max_model_len)
    g.add_argument("--model-seed", type=int, default=d.seed)


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        name=args.model_name,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        d_ff=args.d_ff,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        seed=args.model_seed,
    )


def add_timeout_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("deadlines")
    g.add_argument("--transfer-timeout", type=float, default=30.0, help="vLLM's transfer_timeout, seconds")
    g.add_argument("--control-timeout", type=float, default=5.0)
    g.add_argument("--admission-timeout", type=float, default=10.0)
