"""Control-plane frames: the 4-byte big-endian length header and the limit, at its edges."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moriio_async.core.framing import DEFAULT_MAX_FRAME, HEADER, FrameError, frame, parse_header
from moriio_async.errors import ControlPlaneError


def test_the_header_is_four_bytes_big_endian_known_answers() -> None:
    assert HEADER.size == 4
    assert DEFAULT_MAX_FRAME == 1 << 20
    assert frame(b"x") == b"\x00\x00\x00\x01x"
    assert frame(b"ab" * 150) == b"\x00\x00\x01\x2c" + b"ab" * 150
    assert frame(b"") == b"\x00\x00\x00\x00"  # framing the empty body is allowed; reading one back is not
    assert parse_header(b"\x00\x00\x00\x01") == 1
    assert parse_header(b"\x00\x01\x00\x00") == 1 << 16
    assert parse_header(b"\x00\x10\x00\x00") == DEFAULT_MAX_FRAME  # the default limit itself is accepted
    assert type(parse_header(b"\x00\x00\x00\x07")) is int


def test_a_body_at_the_limit_is_framed_one_byte_over_is_refused_with_both_sizes() -> None:
    assert frame(b"z" * 8, max_frame=8) == b"\x00\x00\x00\x08" + b"z" * 8
    with pytest.raises(FrameError) as info:
        frame(b"z" * 9, max_frame=8)
    assert str(info.value) == "control message of 9 bytes exceeds the 8-byte frame limit"
    assert len(frame(b"y" * DEFAULT_MAX_FRAME)) == DEFAULT_MAX_FRAME + 4  # the default limit, exactly
    with pytest.raises(FrameError, match=f"of {DEFAULT_MAX_FRAME + 1} bytes exceeds the {DEFAULT_MAX_FRAME}-byte"):
        frame(b"y" * (DEFAULT_MAX_FRAME + 1))


def test_a_length_outside_one_to_the_limit_is_refused_with_the_range() -> None:
    assert parse_header(b"\x00\x00\x00\x08", max_frame=8) == 8
    assert parse_header(b"\x00\x00\x00\x01", max_frame=1) == 1
    for header, limit in ((b"\x00\x00\x00\x00", 8), (b"\x00\x00\x00\x09", 8), (b"\xff\xff\xff\xff", 8)):
        length = int.from_bytes(header, "big")
        with pytest.raises(FrameError) as info:
            parse_header(header, max_frame=limit)
        assert str(info.value) == f"frame length {length} outside 1..{limit}"
    with pytest.raises(FrameError) as info:
        parse_header((DEFAULT_MAX_FRAME + 1).to_bytes(4, "big"))
    assert str(info.value) == f"frame length {DEFAULT_MAX_FRAME + 1} outside 1..{DEFAULT_MAX_FRAME}"
    with pytest.raises(FrameError) as info:
        parse_header(b"\x00\x00\x00\x00")
    assert str(info.value) == "frame length 0 outside 1..1048576"


def test_a_frame_error_is_a_control_plane_error() -> None:
    """The listener answers and closes on ControlPlaneError: a bad frame must be one."""
    assert issubclass(FrameError, ControlPlaneError)


@given(body=st.binary(min_size=1, max_size=300), slack=st.integers(0, 3))
def test_frame_then_parse_gives_the_body_back(body: bytes, slack: int) -> None:
    limit = len(body) + slack
    wire = frame(body, max_frame=limit)
    assert wire[4:] == body
    assert parse_header(wire[:4], max_frame=limit) == len(body)
    if slack == 0 and len(body) > 1:
        with pytest.raises(FrameError):
            parse_header(wire[:4], max_frame=limit - 1)
        with pytest.raises(FrameError):
            frame(body, max_frame=limit - 1)
