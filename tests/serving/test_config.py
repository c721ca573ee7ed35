"""The serving settings: the model and deadline flags every process of a fleet parses, what an instance
refuses to start with, and the deadlines derived from the flags (a lease, decode's wait, a proxy leg)."""

from __future__ import annotations

import argparse

import pytest

from moriio_async.serving.config import (
    InstanceSettings,
    ProxySettings,
    add_model_args,
    add_timeout_args,
    model_config,
)
from moriio_async.serving.model import ModelConfig

SMALL = ModelConfig(d_model=16, n_layers=2, n_heads=2, d_ff=32, block_size=4, max_model_len=32)


def parser(small: ModelConfig | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_model_args(p, small)
    add_timeout_args(p)
    return p


def test_without_model_flags_a_process_builds_the_model_it_was_given_or_the_default() -> None:
    assert model_config(parser(SMALL).parse_args([])) == SMALL
    assert model_config(parser().parse_args([])) == ModelConfig()


def test_each_model_flag_sets_its_own_field() -> None:
    argv = "--model-name m --d-model 24 --layers 3 --heads 3 --d-ff 40 --block-size 5 --max-model-len 50"
    got = model_config(parser(SMALL).parse_args([*argv.split(), "--model-seed", "7"]))
    assert got == ModelConfig("m", d_model=24, n_layers=3, n_heads=3, d_ff=40, block_size=5, max_model_len=50, seed=7)


def test_deadline_flags_default_to_the_settings_defaults_and_take_fractions() -> None:
    args = parser().parse_args([])
    assert (args.transfer_timeout, args.control_timeout, args.admission_timeout) == (30.0, 5.0, 10.0)
    argv = ["--transfer-timeout", "0.5", "--control-timeout", "0.25", "--admission-timeout", "1.5"]
    args = parser().parse_args(argv)
    assert (args.transfer_timeout, args.control_timeout, args.admission_timeout) == (0.5, 0.25, 1.5)


def test_an_instance_needs_blocks_for_one_whole_sequence() -> None:
    need = SMALL.blocks_for(SMALL.max_model_len)
    assert InstanceSettings("p", "prefill", SMALL, need).num_blocks == need
    with pytest.raises(ValueError, match=f"{need - 1} KV blocks cannot hold one max_model_len sequence \\({need}"):
        InstanceSettings("p", "prefill", SMALL, need - 1)


@pytest.mark.parametrize("name", ["transfer_timeout", "control_timeout", "admission_timeout"])
@pytest.mark.parametrize("value", [0.0, -1.0])
def test_every_deadline_must_be_positive(name: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"^{name} must be > 0$"):
        InstanceSettings("p", "prefill", SMALL, 16, **{name: value})  # type: ignore[arg-type]


def test_the_derived_deadlines_add_up_the_waits_they_cover() -> None:
    """A lease covers a reader's transfer deadline, its abort and two control exchanges, twice over; decode
    waits for admission, the writes and two control exchanges; a proxy leg for all of an instance's deadlines."""
    s = InstanceSettings("p", "prefill", SMALL, 16, transfer_timeout=3.0, control_timeout=0.5, admission_timeout=7.0)
    assert s.lease_timeout == 2 * 3.0 + 2 * 0.5
    assert s.write_wait_timeout == 7.0 + 3.0 + 2 * 0.5
    proxy = ProxySettings(["p"], ["d"], SMALL, transfer_timeout=3.0, control_timeout=0.5, admission_timeout=7.0)
    assert proxy.leg_timeout == 2 * (7.0 + 3.0) + 6 * 0.5


def test_help_groups_the_model_and_deadline_flags_and_says_what_they_mean() -> None:
    text = " ".join(parser().format_help().split())  # argparse wraps lines at the terminal's width
    assert "model (every process of a fleet needs the same values):" in text
    assert "--block-size BLOCK_SIZE tokens per KV block" in text
    assert "deadlines:" in text
    assert "--transfer-timeout TRANSFER_TIMEOUT vLLM's transfer_timeout, seconds" in text
