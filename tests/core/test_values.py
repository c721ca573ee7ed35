from __future__ import annotations

import pytest

import moriio_async
from moriio_async import EngineDesc, InvalidArgument, MemoryDesc, TransferError, TransferFailed, TransferTimeout
from moriio_async.core.framing import FrameError, frame, parse_header
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
