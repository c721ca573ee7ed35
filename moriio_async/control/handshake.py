"""The hello, both sides: who is on a new link, and, with a shared secret, proof that it holds it.

With a secret (``core.auth``), the dialer sends ``hello`` with ``auth`` and a
fresh nonce; the listener answers ``challenge`` with its own nonce and its
proof over the transcript (both keys, both incarnations, both nonces), and no
memory; the dialer checks that proof, then sends its own; the listener checks
it, and only then is the link bound to the dialer's key and ``welcome``
sent with the exported memory. Every region a welcome lists must name the
welcoming engine, at its incarnation, as its owner: the dialer refuses one
that lists another engine's. Either side that cannot verify the other
refuses with reason ``auth`` and closes. A secret on one side only is refused
the same way, with a message that says so. The proofs also cover both
ends' transports (the backends each advertises in its engine descriptor), so a
session's choice of backend cannot be steered by anyone between them. Without a secret on either side,
``hello`` is answered by ``welcome`` directly.

Nothing here changes the engine's state: the listener side returns who
proved what, and the peer table decides whether to adopt it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.auth import NONCE_BYTES, SECRET_ENV, Transcript, new_nonce
from ..core.protocol import Challenge, Hello, Proof, Refused, Welcome, proven_transports
from ..descriptors import EngineDesc
from ..errors import AuthenticationError, ControlPlaneError
from .link import ControlLink

__all__ = ["Greeting", "Handshake", "HelloRefused"]

_AGREE = f"give both engines the same secret (IOEngineConfig.secret or ${SECRET_ENV}), or neither"


def _check_regions(welcome: Welcome, link: ControlLink, error: type[ControlPlaneError]) -> None:
    """Every region a welcome lists belongs to the engine that welcomes (key and incarnation).

    A region descriptor names its owner in its body; the dialer's sessions go to that owner. Taken on
    trust, a listener could hand out another engine's regions as its own, and the dialer's writes
    meant for it would land in that other engine's memory.
    """
    engine = welcome.engine
    for region in welcome.memory:
        if region.engine_key != engine.key or region.incarnation != engine.incarnation:
            raise error(
                f"engine {engine.key!r} at {link.peer_address} welcomed with region {region.name!r} of engine "
                f"{region.engine_key!r} (incarnation {region.incarnation:#x}): an engine lists only its own"
            )


class HelloRefused(ControlPlaneError):
    """The listener refuses a hello: what to answer (``reason``, ``re``) and what to count."""

    def __init__(self, reason: str, message: str, re: int | None, *, key: str | None = None, auth: bool = False):
        super().__init__(message)
        self.reason = reason
        self.re = re
        self.key = key
        """The engine key the hello claimed (None if it did not get that far)."""
        self.auth = auth
        """A failed proof, or a secret on one side only."""


@dataclass(frozen=True, slots=True)
class Greeting:
    """A hello the listener may accept: who said it, the id to answer, and the session key if it proved."""

    desc: EngineDesc
    reply_to: int
    session_key: bytes | None


class Handshake:
    """One engine's side of every hello: its secret (or none) and its key limit."""

    def __init__(self, secret: bytes | None, *, max_key: int) -> None:
        self._secret = secret
        self.max_key = max_key

    @property
    def authenticates(self) -> bool:
        return self._secret is not None

    async def dial(self, link: ControlLink, local: EngineDesc) -> tuple[Welcome, bytes | None]:
        """Say hello on a link this engine dialed; the welcome and, with a secret, the session key."""
        secret = self._secret
        if secret is None:
            welcome = await link.request(Hello(engine=local), Welcome)
            _check_regions(welcome, link, ControlPlaneError)
            return welcome, None
        nonce = new_nonce()
        challenge = await link.request(Hello(engine=local, auth=True, nonce=nonce), Challenge)
        listener = challenge.engine
        transcript = Transcript(
            local.key, local.incarnation, nonce, listener.key, listener.incarnation, challenge.nonce,
            proven_transports(local, listener),
        )  # fmt: skip
        if len(challenge.nonce) != NONCE_BYTES or not transcript.verify(secret, "listener", challenge.proof):
            await link.refuse("auth", f"engine {local.key!r} could not verify your proof: the secrets differ")
            raise AuthenticationError(
                f"engine {listener.key!r} at {link.peer_address} failed to prove the shared secret", hint=_AGREE
            )
        welcome = await link.request(Proof(proof=transcript.proof(secret, "dialer")), Welcome)
        if welcome.engine != listener:
            raise AuthenticationError(f"{link.peer_address} welcomed as another engine than the one that proved")
        _check_regions(welcome, link, AuthenticationError)
        return welcome, transcript.session_key(secret)

    async def answer(self, link: ControlLink, local: EngineDesc) -> Greeting | None:
        """Read and check the hello on an accepted link (and the proof, with a secret).

        None if the client left before saying anything; ``HelloRefused`` says
        how to refuse; ``FrameError`` for a frame that is not a message.
        The caller bounds the whole exchange with one deadline.
        """
        first = await link.read_message(idle_ok=False)
        if first is None:
            return None
        if not isinstance(first, Hello):
            raise HelloRefused("handshake", "the first control frame must be a hello request", None)
        key = first.engine.key
        if len(key) > self.max_key:
            raise HelloRefused("handshake", f"engine key of {len(key)} characters exceeds {self.max_key}", first.id)
        secret = self._secret
        if secret is None:
            if first.auth:
                why = f"engine {local.key!r} has no shared secret, but {key!r} authenticates: set the same one on both"
                raise HelloRefused("auth", why, first.id, key=key, auth=True)
            return Greeting(first.engine, first.id, None)
        if not first.auth:
            why = f"engine {local.key!r} accepts only peers that prove its shared secret, and {key!r} has none"
            raise HelloRefused("auth", why, first.id, key=key, auth=True)
        if len(first.nonce) != NONCE_BYTES:
            raise HelloRefused("auth", f"the hello's nonce must have {NONCE_BYTES} bytes", first.id, key=key, auth=True)
        listener_nonce = new_nonce()
        transcript = Transcript(
            key, first.engine.incarnation, first.nonce, local.key, local.incarnation, listener_nonce,
            proven_transports(first.engine, local),
        )  # fmt: skip
        proof = transcript.proof(secret, "listener")
        await link.send(Challenge(re=first.id, engine=local, nonce=listener_nonce, proof=proof))
        second = await link.read_message(idle_ok=False)
        if second is None or isinstance(second, Refused):
            why = second.message if second is not None else "it closed the connection before proving"
            raise HelloRefused(
                "auth", f"the dialer did not accept this engine's proof: {why}", None, key=key, auth=True
            )
        if not isinstance(second, Proof):
            raise HelloRefused("auth", "a challenge must be answered with a proof", None, key=key, auth=True)
        if not transcript.verify(secret, "dialer", second.proof):
            why = f"{key!r}'s proof does not match engine {local.key!r}'s secret"
            raise HelloRefused("auth", why, second.id, key=key, auth=True)
        return Greeting(first.engine, second.id, transcript.session_key(secret))
