from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

import moriio_async
from moriio_async import EngineDesc, InvalidArgument, MemoryDesc, TransferError, TransferFailed, TransferTimeout
from moriio_async.core.framing import FrameError, frame, parse_header
from moriio_async.descriptors import MAX_KEY, MAX_TRANSPORTS
from moriio_async.status import Access, StatusCode, WcStatus


def test_every_export_exists_and_all_is_sorted() -> None:
    for name in moriio_async.__all__:
        assert hasattr(moriio_async, name), name
    assert sorted(moriio_async.__all__) == moriio_async.__all__


def test_status_codes_keep_mori_and_verbs_numbers() -> None:
    assert [StatusCode.SUCCESS, StatusCode.INIT, StatusCode.IN_PROGRESS] == [0, 1, 2]
    assert StatusCode.ERR_INVALID_ARGS == 11 and StatusCode.ERR_BAD_STATE == 14
    assert WcStatus.WR_FLUSH_ERR == 5 and WcStatus.REM_ACCESS_ERR == 10 and WcStatus.RETRY_EXC_ERR == 12
    assert WcStatus.parse(999) is WcStatus.GENERAL_ERR


def test_descriptors_round_trip_and_reject_garbage() -> None:
    e = EngineDesc("prefill-0", "127.0.0.1", 5555, 2**62, "tcp")
    assert EngineDesc.unpack(e.pack()) == e
    m = MemoryDesc("prefill-0", 7, "kv", 0x7F0000001000, 4096, 0x1234, Access.REMOTE_READ)
    assert MemoryDesc.unpack(m.pack()) == m
    for raw in [b"not json", b"[]", e.pack(), b'{"kind":"MemoryDesc","addr":"x"}']:
        with pytest.raises(InvalidArgument):
            MemoryDesc.unpack(raw)


PACKED_ENGINE = json.loads(EngineDesc("e", "127.0.0.1", 1, 2, "tcp").pack())
PACKED_REGION = json.loads(MemoryDesc("e", 2, "kv", 4096, 64, 7, Access.REMOTE_READ).pack())


@pytest.mark.parametrize(
    ("packed", "field", "value"),
    [
        (PACKED_ENGINE, "key", "k" * (MAX_KEY + 1)),
        (PACKED_ENGINE, "key", ""),
        (PACKED_ENGINE, "host", 3),
        (PACKED_ENGINE, "port", 65536),
        (PACKED_ENGINE, "incarnation", 1 << 64),
        (PACKED_ENGINE, "transports", [{"name": "tcp"}] * (MAX_TRANSPORTS + 1)),
        (PACKED_ENGINE, "backend", None),
        (PACKED_REGION, "name", "n" * (MAX_KEY + 1)),
        (PACKED_REGION, "addr", 1 << 64),
        (PACKED_REGION, "length", 0),
        (PACKED_REGION, "rkey", -1),
        (PACKED_REGION, "access", True),
        (PACKED_REGION, "rkeys", {f"b{i}": 1 for i in range(MAX_TRANSPORTS + 1)}),
        (PACKED_REGION, "engine_key", None),
    ],
)
def test_unpack_refuses_a_field_past_its_bound_by_its_name(packed: dict[str, Any], field: str, value: object) -> None:
    kind = EngineDesc if packed["kind"] == "EngineDesc" else MemoryDesc
    raw = json.dumps({**packed, field: value})
    with pytest.raises(InvalidArgument, match=rf"^cannot unpack {kind.__name__}: .*`(\$\.)?{field}`"):
        kind.unpack(raw)


def test_unpack_refuses_what_is_not_a_descriptor_with_invalid_argument_only() -> None:
    for raw in [b"", b"{", b"\xff", b"3", b'{"kind": 3}', b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"]:
        with pytest.raises(InvalidArgument, match=r"^cannot unpack EngineDesc: "):
            EngineDesc.unpack(raw)
    without = {k: v for k, v in PACKED_ENGINE.items() if k != "port"}
    with pytest.raises(InvalidArgument, match="missing required field `port`"):
        EngineDesc.unpack(json.dumps(without))


def test_descriptors_are_values_hashable_and_rkeys_given_as_pairs_are_kept_as_a_mapping() -> None:
    pairs = MemoryDesc("e", 2, "kv", 4096, 64, 7, Access.all(), (("cma", 7), ("tcp", 9)))  # type: ignore[arg-type]
    mapping = MemoryDesc("e", 2, "kv", 4096, 64, 7, Access.all(), {"tcp": 9, "cma": 7})
    assert pairs == mapping and hash(pairs) == hash(mapping) and pairs.rkeys == {"cma": 7, "tcp": 9}
    assert len({pairs, mapping, msgspec.structs.replace(mapping, rkeys={})}) == 2
    with pytest.raises(AttributeError):
        pairs.rkey = 1  # type: ignore[misc]


def test_transfer_error_is_an_exception_group_with_mori_message() -> None:
    err = TransferError.build(
        [TransferFailed("REM_ACCESS_ERR", transfer_id=3)], [TransferTimeout(4, 2.0, peer="b")], 10
    )
    assert isinstance(err, ExceptionGroup)
    assert str(err).splitlines() == [
        "2/10 transfers failed:",
        "transfer 3: RDMA transfer failed: REM_ACCESS_ERR (code=13)",
        "transfer 4: timed out after 2s (still in flight to b)",
    ]
    assert [e.transfer_id for e in err.failed] == [3]
    assert [e.transfer_id for e in err.timed_out] == [4]
    with pytest.raises(ExceptionGroup) as info:
        try:
            raise err
        except* TransferTimeout as group:
            assert isinstance(group, TransferError)
            raise
    assert info.value is not None


def test_frames_round_trip_and_limits() -> None:
    framed = frame(b'{"op":"x"}')
    assert framed[4:] == b'{"op":"x"}'
    assert parse_header(framed[:4]) == len(framed) - 4
    with pytest.raises(FrameError):
        parse_header((1 << 21).to_bytes(4, "big"), max_frame=1 << 20)
    with pytest.raises(FrameError):
        parse_header(b"\0\0\0\0")
    with pytest.raises(FrameError):
        frame(b"a" * 100, max_frame=50)
