"""The demo's fleet runs with a shared secret unless told not to, handed to every child in its environment."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from moriio_async.core.auth import SECRET_ENV, load_secret
from moriio_async.serving.demo import add_demo_parser, fleet_secret
from moriio_async.serving.launcher import SECRET_ENV as LAUNCHER_SECRET_ENV
from moriio_async.serving.launcher import Launcher


def demo_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_demo_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["demo", *argv])


def test_by_default_every_child_gets_a_fresh_random_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert LAUNCHER_SECRET_ENV == SECRET_ENV  # the variable the engines read
    args = demo_args()
    assert not args.no_secret
    envs = [Launcher(tmp_path, fleet_secret(args.no_secret)).env for _ in range(2)]
    secrets = [env[SECRET_ENV] for env in envs]
    assert secrets[0] != secrets[1] and all(len(s) >= 32 for s in secrets)
    assert load_secret(None, envs[0]) == secrets[0].encode()  # what a child's engine then uses


def test_a_secret_in_the_environment_is_the_fleets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, "the-operators-own-secret")
    assert Launcher(tmp_path, fleet_secret(False)).env[SECRET_ENV] == "the-operators-own-secret"


def test_no_secret_turns_it_off_even_when_the_environment_has_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SECRET_ENV, "the-operators-own-secret")
    args = demo_args("--no-secret")
    assert args.no_secret and fleet_secret(args.no_secret) is None
    assert SECRET_ENV not in Launcher(tmp_path, fleet_secret(args.no_secret)).env
