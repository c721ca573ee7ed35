"""integrations.settings: transport and secret from kv_connector_extra_config, the environment as fallback."""

from __future__ import annotations

import pytest

from moriio_async.integrations.settings import SECRET_ENV, TRANSPORT_ENV, ConnectorSettings

SECRET = "s" * 32


def test_the_extra_config_wins_over_the_environment() -> None:
    env = {TRANSPORT_ENV: "tcp", SECRET_ENV: "e" * 32}
    got = ConnectorSettings.resolve({"transport": "CMA", "secret": SECRET}, env)
    assert got == ConnectorSettings("cma", SECRET)


def test_the_environment_fills_what_the_extra_config_leaves_out() -> None:
    assert ConnectorSettings.resolve({}, {TRANSPORT_ENV: "verbs", SECRET_ENV: SECRET}) == ConnectorSettings(
        "verbs", SECRET
    )
    assert ConnectorSettings.resolve(None, {}) == ConnectorSettings("auto", None)
    assert ConnectorSettings.resolve({"secret": ""}, {}) == ConnectorSettings("auto", None)


@pytest.mark.parametrize("transport", ["rdma", "xgmi", "shm", ""])
def test_an_unknown_transport_is_refused_at_start_naming_the_key(transport: str) -> None:
    extra = {"transport": transport} if transport else {}
    env = {TRANSPORT_ENV: "nic"} if not transport else {}
    with pytest.raises(ValueError, match="transport="):
        ConnectorSettings.resolve(extra, env)


def test_a_short_secret_is_refused_naming_where_it_came_from() -> None:
    with pytest.raises(ValueError, match=r"kv_connector_extra_config\.secret"):
        ConnectorSettings.resolve({"secret": "short"}, {})
    with pytest.raises(ValueError, match=r"\$MORIIO_ASYNC_SECRET"):
        ConnectorSettings.resolve({}, {SECRET_ENV: "short"})


def test_apply_sets_what_compat_engines_read_and_keeps_an_absent_secret_absent() -> None:
    env: dict[str, str] = {}
    ConnectorSettings("tcp", None).apply(env)
    assert env == {TRANSPORT_ENV: "tcp"}
    ConnectorSettings("cma", SECRET).apply(env)
    assert env == {TRANSPORT_ENV: "cma", SECRET_ENV: SECRET}
