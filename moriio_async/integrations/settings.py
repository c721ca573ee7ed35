"""The connector's moriio_async settings: from ``kv_connector_extra_config``, else the environment.

Keys read from ``kv_connector_extra_config`` (every other key is vLLM's own):

- ``"transport"``: ``auto`` (the default: cma with a peer on this host, verbs
  where a device works, else tcp, chosen per session), ``cma``, ``tcp`` or
  ``verbs`` (no fallback). Environment fallback: ``MORIIO_COMPAT_RDMA_BACKEND``.
- ``"secret"``: the deployment's shared secret (at least 16 bytes). vLLM logs
  its whole config at start, so prefer the environment variable
  ``MORIIO_ASYNC_SECRET``, which is read when the key is absent.

The engine inside vLLM is built by vLLM's connector (``IOEngine(key,
IOEngineConfig(ip, port))``), which has no room for either, so ``apply`` puts
them where the compat layer and the engine read them: this process's
environment, before the connector builds its engine (and inherited by the
workers vLLM starts afterwards).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

__all__ = ["TRANSPORTS", "TRANSPORT_ENV", "ConnectorSettings"]

TRANSPORT_ENV = "MORIIO_COMPAT_RDMA_BACKEND"
SECRET_ENV = "MORIIO_ASYNC_SECRET"
TRANSPORTS = ("auto", "cma", "tcp", "verbs")
MIN_SECRET_BYTES = 16


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    transport: str
    secret: str | None

    @classmethod
    def resolve(cls, extra: Mapping[str, object] | None, environ: Mapping[str, str] | None = None) -> ConnectorSettings:
        """Settings from the connector's extra config, the environment filling what it leaves out.

        Raises ``ValueError`` naming the key on a bad transport or a short secret,
        so a misconfigured server fails at start, not at its first transfer.
        """
        extra = extra or {}
        env = os.environ if environ is None else environ
        transport = str(extra.get("transport") or env.get(TRANSPORT_ENV) or "auto").strip().lower()
        if transport not in TRANSPORTS:
            raise ValueError(
                f"kv_connector_extra_config.transport={transport!r}: expected one of {', '.join(TRANSPORTS)}"
            )
        raw = extra.get("secret")
        secret = str(raw) if raw not in (None, "") else (env.get(SECRET_ENV) or None)
        if secret is not None and len(secret.encode()) < MIN_SECRET_BYTES:
            where = "kv_connector_extra_config.secret" if raw not in (None, "") else f"${SECRET_ENV}"
            raise ValueError(f"{where} is shorter than {MIN_SECRET_BYTES} bytes: use a random secret")
        return cls(transport, secret)

    def apply(self, environ: MutableMapping[str, str] | None = None) -> None:
        """Make these the settings of every compat engine this process (and its children) builds."""
        env = os.environ if environ is None else environ
        env[TRANSPORT_ENV] = self.transport
        if self.secret is not None:
            env[SECRET_ENV] = self.secret
