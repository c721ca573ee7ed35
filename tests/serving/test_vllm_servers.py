"""serving.vllm.servers: a ServerSpec's command line and environment, with and without its overrides."""

from __future__ import annotations

import json
from pathlib import Path

from moriio_async.serving.vllm.servers import ServerSpec, VllmFleet

PY = Path("/venv/bin/python")
NIXL: dict[str, object] = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}


def config_of(argv: list[str]) -> object:
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


def test_default_spec_is_moriio_connector_on_moriio_async() -> None:
    spec = ServerSpec("p", Path("/m"), role="kv_producer", port=8100, handshake_port=6301, notify_port=61005)
    cfg = config_of(spec.argv(PY))
    assert isinstance(cfg, dict)
    assert cfg["kv_connector"] == "MoRIIOAsyncConnector"
    assert cfg["kv_connector_module_path"] == "moriio_async.integrations.vllm"
    assert cfg["kv_connector_extra_config"]["handshake_port"] == "6301"


def test_reference_has_no_connector() -> None:
    assert "--kv-transfer-config" not in ServerSpec("ref", Path("/m")).argv(PY)


def test_kv_transfer_override_replaces_the_connector_config() -> None:
    spec = ServerSpec("p", Path("/m"), role="kv_producer", kv_transfer=NIXL)
    assert config_of(spec.argv(PY)) == NIXL


def test_kv_transfer_override_applies_without_a_role() -> None:
    assert config_of(ServerSpec("p", Path("/m"), kv_transfer=NIXL).argv(PY)) == NIXL


def test_extra_args_end_the_command_line() -> None:
    spec = ServerSpec("p", Path("/m"), role="kv_consumer", args=["--kv-cache-memory-bytes", "268435456"])
    argv = spec.argv(PY)
    assert argv[-2:] == ["--kv-cache-memory-bytes", "268435456"]
    assert argv[:3] == [str(PY), "-m", "vllm.entrypoints.openai.api_server"]


def test_spec_env_is_added_to_the_fleet_env_for_that_server_only(tmp_path: Path) -> None:
    fleet = VllmFleet(PY, tmp_path, env={"UCX_TLS": "tcp", "VLLM_CPU_KVCACHE_SPACE": "1"})
    own = ServerSpec("p", Path("/m"), env={"VLLM_NIXL_SIDE_CHANNEL_PORT": "5601", "UCX_TLS": "cma,tcp"})
    other = ServerSpec("d", Path("/m"))
    env = fleet.env_for(own)
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5601"
    assert env["UCX_TLS"] == "cma,tcp"  # the spec's own value wins
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["VLLM_HOST_IP"] == "127.0.0.1"
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in fleet.env_for(other)
    assert fleet.env_for(other)["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_spec_env_none_removes_a_fleet_variable(tmp_path: Path) -> None:
    fleet = VllmFleet(PY, tmp_path, env={})
    env = fleet.env_for(ServerSpec("p", Path("/m"), env={"VLLM_CPU_KVCACHE_SPACE": None, "NOT_SET_ANYWHERE": None}))
    assert "VLLM_CPU_KVCACHE_SPACE" not in env and "NOT_SET_ANYWHERE" not in env
    assert "VLLM_CPU_KVCACHE_SPACE" in fleet.env_for(ServerSpec("d", Path("/m")))
