from __future__ import annotations

import hmac

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


def transcript_message(label: bytes) -> bytes:
    """The documented transcript, written out independently: each field as a 4-byte big-endian length
    and its bytes, in this order: the protocol tag, the label, the dialer's key, incarnation (8 bytes,
    big-endian) and nonce, then the listener's."""

    def field(data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + data

    return b"".join(
        field(x)
        for x in (
            b"moriio-async/1",
            label,
            b"decode-0",
            (7).to_bytes(8, "big"),
            b"a" * 32,
            b"prefill-0",
            (9).to_bytes(8, "big"),
            b"b" * 32,
        )
    )


def test_proofs_and_the_session_key_are_the_documented_hmacs() -> None:
    """Both ends computing the same (wrong) thing would pass every round-trip test: pin the construction,
    and known answers a second implementation can check itself against."""
    import hashlib
    import hmac

    t = transcript()
    for role in ("dialer", "listener"):
        expected = hmac.new(SECRET, transcript_message(b"proof:" + role.encode()), hashlib.sha256).digest()
        assert t.proof(SECRET, role) == expected
    assert t.session_key(SECRET) == hmac.new(SECRET, transcript_message(b"session"), hashlib.sha256).digest()
    assert t.proof(SECRET, "dialer").hex() == "9953e749ab6334e8953cfe886d444004d3242cc328bb7549999aba22d4472987"
    assert t.proof(SECRET, "listener").hex() == "ae1a7338c284cd0902daadcfaed0f21b93101151937570d3eafb47706bbf4083"
    assert t.session_key(SECRET).hex() == "d5016f113ab0b29cf8a85e62c744e1c4e7a245c683c9abdf8d7d9319fb671a0e"


def test_an_unknown_role_is_refused_and_verify_checks_the_proof_bytes() -> None:
    t = transcript()
    for role in ("", "Dialer", "session", "proof:dialer"):
        with pytest.raises(ValueError, match=f"^role {role!r}$"):
            t.proof(SECRET, role)
    proof = t.proof(SECRET, "listener")
    assert t.verify(SECRET, "listener", proof)
    assert not t.verify(SECRET, "listener", proof[:-1])
    assert not t.verify(SECRET, "listener", proof[:-1] + bytes([proof[-1] ^ 1]))
    assert not t.verify(SECRET, "listener", b"")


def test_a_nonce_is_32_fresh_bytes() -> None:
    nonces = {new_nonce() for _ in range(64)}
    assert len(nonces) == 64
    assert {len(n) for n in nonces} == {32}


def test_the_secret_boundary_types_and_the_error_text(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_secret(b"k" * 16, {}) == b"k" * 16  # exactly the minimum
    assert load_secret("é" * 8, {}) == "é".encode() * 8  # UTF-8: 16 bytes from 8 characters
    with pytest.raises(InvalidArgument) as info:
        load_secret("k" * 15, {})
    assert "the shared secret has 15 bytes; use at least 16" in str(info.value)
    assert info.value.hint == 'generate one with: python3 -c "import secrets; print(secrets.token_urlsafe(32))"'
    with pytest.raises(InvalidArgument, match="has 0 bytes"):
        load_secret(b"", {"MORIIO_ASYNC_SECRET": "e" * 20})  # given, even empty: the environment is not read
    # No mapping given: the process environment; an empty variable means no secret, not a short one.
    monkeypatch.setenv("MORIIO_ASYNC_SECRET", "v" * 18)
    assert load_secret(None) == b"v" * 18
    assert load_secret(None, {}) is None  # a mapping given: the process environment is not read
    monkeypatch.setenv("MORIIO_ASYNC_SECRET", "")
    assert load_secret(None) is None
    assert load_secret(None, {"MORIIO_ASYNC_SECRET": ""}) is None
    monkeypatch.delenv("MORIIO_ASYNC_SECRET")
    assert load_secret(None) is None
    with pytest.raises(InvalidArgument, match="has 3 bytes"):
        load_secret(None, {"MORIIO_ASYNC_SECRET": "abc"})


def test_verify_compares_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 25 item 2: the check goes through ``hmac.compare_digest`` (spied on; no timing measured)."""
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    t = transcript()
    proof = t.proof(SECRET, "dialer")
    wrong = bytes([proof[0] ^ 1]) + proof[1:]
    assert t.verify(SECRET, "dialer", proof) and not t.verify(SECRET, "dialer", wrong)
    assert compared == [(proof, proof), (proof, wrong)]
