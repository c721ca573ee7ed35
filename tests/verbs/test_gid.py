"""GID choice: the RoCE v2 IPv4-mapped entry unless told otherwise, and always a reason."""

from __future__ import annotations

import pytest

from moriio_async.backends.verbs.facts import (
    GID_TYPE_IB,
    GID_TYPE_ROCE_V1,
    GID_TYPE_ROCE_V2,
    LINK_LAYER_ETHERNET,
    LINK_LAYER_INFINIBAND,
    GidEntry,
)
from moriio_async.backends.verbs.gid import choose_gid
from moriio_async.errors import BackendUnavailable

LINK_LOCAL = "fe80:0000:0000:0000:5054:00ff:fe12:3456"
ROCE_TABLE = [
    GidEntry(0, LINK_LOCAL, GID_TYPE_ROCE_V1),
    GidEntry(1, LINK_LOCAL, GID_TYPE_ROCE_V2),
    GidEntry(2, "0000:0000:0000:0000:0000:ffff:0a00:0001", GID_TYPE_ROCE_V1),
    GidEntry(3, "0000:0000:0000:0000:0000:ffff:0a00:0001", GID_TYPE_ROCE_V2),
    GidEntry(4, "0000:0000:0000:0000:0000:ffff:0a00:0102", GID_TYPE_ROCE_V2),
]


def test_default_is_the_first_roce_v2_ipv4_entry() -> None:
    choice = choose_gid(ROCE_TABLE, link_layer=LINK_LAYER_ETHERNET, requested=None, host="127.0.0.1")
    assert choice.entry.index == 3
    assert "RoCE v2" in choice.reason
    assert "10.0.0.1" in choice.reason


def test_the_hosts_own_entry_wins() -> None:
    choice = choose_gid(ROCE_TABLE, link_layer=LINK_LAYER_ETHERNET, requested=None, host="10.0.1.2")
    assert choice.entry.index == 4
    assert "10.0.1.2" in choice.reason


def test_unknown_host_is_said_in_the_reason() -> None:
    choice = choose_gid(ROCE_TABLE, link_layer=LINK_LAYER_ETHERNET, requested=None, host="192.0.2.9")
    assert choice.entry.index == 3
    assert "192.0.2.9 has no GID" in choice.reason


def test_requested_index_is_used_as_is() -> None:
    choice = choose_gid(ROCE_TABLE, link_layer=LINK_LAYER_ETHERNET, requested=0, host=None)
    assert choice.entry.index == 0
    assert "requested" in choice.reason


def test_requested_index_that_is_absent_says_what_is_there() -> None:
    with pytest.raises(BackendUnavailable, match=r"indexes present: \[0, 1, 2, 3, 4\]"):
        choose_gid(ROCE_TABLE, link_layer=LINK_LAYER_ETHERNET, requested=9, host=None)


def test_ipv6_only_roce_v2_falls_back_with_a_reason() -> None:
    choice = choose_gid(ROCE_TABLE[:2], link_layer=LINK_LAYER_ETHERNET, requested=None, host=None)
    assert choice.entry.index == 1
    assert "IPv6" in choice.reason


def test_infiniband_uses_the_port_gid() -> None:
    table = [GidEntry(0, LINK_LOCAL, GID_TYPE_IB)]
    assert choose_gid(table, link_layer=LINK_LAYER_INFINIBAND, requested=None, host=None).entry.index == 0


def test_empty_table_is_unavailable_with_a_fix() -> None:
    zero = GidEntry(0, "0000:0000:0000:0000:0000:0000:0000:0000", GID_TYPE_ROCE_V2)
    with pytest.raises(BackendUnavailable) as info:
        choose_gid([zero], link_layer=LINK_LAYER_ETHERNET, requested=None, host=None)
    assert info.value.hint is not None
    assert "IP address" in info.value.hint
