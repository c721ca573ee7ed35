"""Peer authentication by a shared secret: challenge and response, with no I/O and no asyncio.

Two engines that share a secret prove it to each other in the control-plane
hello without the secret ever crossing the wire. Each side draws a fresh
nonce; each proof is an HMAC-SHA256 under the secret over a transcript that
names the role, both nonces, both engine keys and both incarnations, so a
proof cannot be replayed on another connection (other nonces), reflected back
to its sender (other role), or moved to another engine identity (the keys and
incarnations are inside). The same transcript, under another label, gives the
link's session key, from which every data-plane connection's single-use
token is derived.

This authenticates; it does not encrypt. Anyone on the path can read control
messages and data. Run engines on a trusted network, or under TLS/IPsec.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import InvalidArgument

__all__ = ["NONCE_BYTES", "SECRET_ENV", "Transcript", "load_secret", "new_nonce", "token_for"]

NONCE_BYTES = 32
SECRET_ENV = "MORIIO_ASYNC_SECRET"
"""The environment variable read when ``IOEngineConfig.secret`` is not given."""
MIN_SECRET_BYTES = 16


def load_secret(value: bytes | str | None, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The secret as bytes: ``value``, else ``$MORIIO_ASYNC_SECRET``, else None (no authentication)."""
    if value is None:
        value = (os.environ if environ is None else environ).get(SECRET_ENV) or None
        if value is None:
            return None
    raw = value.encode() if isinstance(value, str) else bytes(value)
    if len(raw) < MIN_SECRET_BYTES:
        raise InvalidArgument(
            f"the shared secret has {len(raw)} bytes; use at least {MIN_SECRET_BYTES}",
            hint='generate one with: python3 -c "import secrets; print(secrets.token_urlsafe(32))"',
        )
    return raw


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def _field(data: bytes) -> bytes:
    return struct.pack("!I", len(data)) + data


@dataclass(frozen=True, slots=True)
class Transcript:
    """What both sides of one hello agree on: who dialed whom, as which incarnations, with which nonces."""

    dialer_key: str
    dialer_incarnation: int
    dialer_nonce: bytes
    listener_key: str
    listener_incarnation: int
    listener_nonce: bytes
    transports: bytes = b""
    """Both ends' advertised transports, encoded by the caller: the proofs cover what each end said it
    can use, so nobody between them can steer a session to another backend. Empty: not part of it."""

    def _message(self, label: bytes) -> bytes:
        # Length-prefixed fields: no two different transcripts encode to the same bytes (an empty
        # ``transports`` is left out, so transcripts without one keep their bytes).
        fields = [
            b"moriio-async/1",
            label,
            self.dialer_key.encode(),
            self.dialer_incarnation.to_bytes(8, "big"),
            self.dialer_nonce,
            self.listener_key.encode(),
            self.listener_incarnation.to_bytes(8, "big"),
            self.listener_nonce,
        ]
        if self.transports:
            fields.append(self.transports)
        return b"".join(_field(x) for x in fields)

    def proof(self, secret: bytes, role: str) -> bytes:
        """The proof that the side playing ``role`` ("dialer" or "listener") holds ``secret``."""
        if role not in ("dialer", "listener"):
            raise ValueError(f"role {role!r}")
        return hmac.new(secret, self._message(b"proof:" + role.encode()), hashlib.sha256).digest()

    def verify(self, secret: bytes, role: str, proof: bytes) -> bool:
        """Constant-time check of the other side's proof."""
        return hmac.compare_digest(self.proof(secret, role), proof)

    def session_key(self, secret: bytes) -> bytes:
        """The key this link's data-plane tokens derive from (never sent)."""
        return hmac.new(secret, self._message(b"session"), hashlib.sha256).digest()


def token_for(session_key: bytes, purpose: str, serial: int) -> bytes:
    """A 16-byte single-use token for the ``serial``-th use of ``purpose`` on one authenticated link."""
    msg = _field(purpose.encode()) + serial.to_bytes(8, "big")
    return hmac.new(session_key, msg, hashlib.sha256).digest()[:16]
