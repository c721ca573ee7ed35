from __future__ import annotations

import pytest

from moriio_async.core.auth import Transcript, load_secret, new_nonce, token_for
from moriio_async.errors import InvalidArgument

SECRET = b"s" * 32


def transcript(**change: object) -> Transcript:
    base: dict[str, object] = {
        "dialer_key": "decode-0",
        "dialer_incarnation": 7,
        "dialer_nonce": b"a" * 32,
        "listener_key": "prefill-0",
        "listener_incarnation": 9,
        "listener_nonce": b"b" * 32,
    }
    base.update(change)
    return Transcript(**base)  # type: ignore[arg-type]


def test_a_proof_verifies_only_under_the_same_secret_role_and_transcript() -> None:
    t = transcript()
    proof = t.proof(SECRET, "dialer")
    assert t.verify(SECRET, "dialer", proof)
    assert not t.verify(b"x" * 32, "dialer", proof)  # another secret
    assert not t.verify(SECRET, "listener", proof)  # reflected back as the other role
    for change in (
        {"dialer_nonce": b"c" * 32},  # replayed on another connection
        {"listener_nonce": b"c" * 32},
        {"dialer_key": "decode-1"},  # moved to another identity
        {"dialer_incarnation": 8},
        {"listener_key": "prefill-1"},
        {"listener_incarnation": 10},
    ):
        assert not transcript(**change).verify(SECRET, "dialer", proof), change


def test_fields_are_length_prefixed_so_keys_cannot_shift_into_nonces() -> None:
    a = transcript(dialer_key="ab", dialer_nonce=b"c" * 32)
    b = transcript(dialer_key="a", dialer_nonce=b"bc" + b"c" * 31)
    assert a.proof(SECRET, "dialer") != b.proof(SECRET, "dialer")


def test_session_keys_and_tokens_differ_per_link_purpose_and_serial() -> None:
    k1 = transcript().session_key(SECRET)
    k2 = transcript(listener_nonce=new_nonce()).session_key(SECRET)
    assert k1 != k2
    assert len(token_for(k1, "qp", 1)) == 16
    assert len({token_for(k1, "qp", 1), token_for(k1, "qp", 2), token_for(k1, "fd", 1), token_for(k2, "qp", 1)}) == 4


def test_secret_from_argument_or_environment_and_too_short_refused() -> None:
    assert load_secret(None, {}) is None
    assert load_secret(None, {"MORIIO_ASYNC_SECRET": "e" * 20}) == b"e" * 20
    assert load_secret("f" * 16, {"MORIIO_ASYNC_SECRET": "e" * 20}) == b"f" * 16
    with pytest.raises(InvalidArgument, match="at least 16"):
        load_secret(b"short", {})


def test_a_token_is_the_documented_hmac_so_both_ends_and_other_implementations_agree() -> None:
    """The wire construction, written out independently: HMAC-SHA256 under the session key over the
    purpose (4-byte big-endian length, then its bytes) and the serial (8 bytes, big-endian), first 16 bytes."""
    import hashlib
    import hmac

    key = bytes(range(32))
    for purpose, serial in (("qp", 0), ("qp", 7), ("data", 2**40 + 3)):
        msg = len(purpose).to_bytes(4, "big") + purpose.encode() + serial.to_bytes(8, "big")
        assert token_for(key, purpose, serial) == hmac.new(key, msg, hashlib.sha256).digest()[:16]
    assert token_for(key, "qp", 1) != token_for(key, "qp", 2) != token_for(key, "qq", 2)
