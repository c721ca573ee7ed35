"""Descriptors: one Struct on every path. Any descriptor within its bounds comes back equal from ``pack()``
and from a control message; any other value of any field is refused, as ``InvalidArgument`` from
``unpack()`` and as ``FrameError`` from ``decode()``, never another exception."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moriio_async import EngineDesc, InvalidArgument, MemoryDesc, TransportDesc
from moriio_async.core.framing import FrameError
from moriio_async.core.protocol import Exports, Hello, Welcome, decode, encode
from moriio_async.descriptors import MAX_KEY, MAX_TRANSPORTS, U64_MAX
from moriio_async.status import Access

from .test_control_plane import json_values

keys = st.text(min_size=1, max_size=MAX_KEY // 64) | st.just("k" * MAX_KEY)
shorts = st.text(max_size=16) | st.just("s" * 255)
backend_names = st.sampled_from(["tcp", "cma", "verbs", "mock", "b" * 16])
u32 = st.integers(0, 0xFFFF_FFFF)
u64 = st.integers(0, U64_MAX)

transports = st.builds(TransportDesc, backend_names, shorts)
engines = st.builds(
    EngineDesc,
    keys,
    shorts,
    st.integers(0, 0xFFFF),
    u64,
    shorts,
    st.lists(transports, max_size=MAX_TRANSPORTS).map(tuple),
)
regions = st.builds(
    MemoryDesc,
    keys,
    u64,
    st.text(max_size=MAX_KEY // 64),
    u64,
    st.integers(1, U64_MAX),
    u32,
    st.sampled_from(list(Access)) | st.just(Access.all()) | st.just(Access(0)),
    st.dictionaries(backend_names, u32, max_size=MAX_TRANSPORTS),
)


@given(engine=engines, memory=st.lists(regions, max_size=4))
def test_descriptors_within_their_bounds_round_trip_packed_and_in_messages(
    engine: EngineDesc, memory: list[MemoryDesc]
) -> None:
    assert EngineDesc.unpack(engine.pack()) == engine
    for region in memory:
        again = MemoryDesc.unpack(region.pack())
        assert again == region and hash(again) == hash(region)
    for message in (Hello(id=1, engine=engine), Welcome(re=1, engine=engine, memory=memory), Exports(memory=memory)):
        assert decode(encode(message)[4:]) == message


@given(data=st.data())
@pytest.mark.parametrize("kind", [EngineDesc, MemoryDesc])
def test_a_descriptor_with_any_field_changed_is_refused_or_round_trips(
    data: st.DataObject, kind: type[EngineDesc] | type[MemoryDesc]
) -> None:
    desc = data.draw(engines if kind is EngineDesc else regions)
    packed: dict[str, Any] = json.loads(desc.pack())
    field = data.draw(st.sampled_from(sorted(packed)))
    value = data.draw(json_values)
    changed = {**packed, field: value}
    try:
        got: EngineDesc | MemoryDesc | None = kind.unpack(json.dumps(changed))
    except InvalidArgument as exc:
        assert str(exc).startswith(f"cannot unpack {kind.__name__}: ")
        got = None
    else:
        assert got is not None and kind.unpack(got.pack()) == got
    sent = {k: v for k, v in changed.items() if k != "kind"}  # the same fields in a message, where no kind is read
    body = {"op": "hello", "id": 1, "engine": sent} if kind is EngineDesc else {"op": "exports", "memory": [sent]}
    try:
        decoded = decode(json.dumps(body).encode())
    except FrameError:
        on_wire = None
    else:
        assert isinstance(decoded, Hello | Exports)
        on_wire = decoded.engine if isinstance(decoded, Hello) else decoded.memory[0]
    if field == "kind":
        assert on_wire == desc and (got is None) == (value != kind.KIND)
    else:
        assert on_wire == got
