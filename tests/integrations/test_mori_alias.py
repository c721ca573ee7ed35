"""integrations.mori_alias: ``mori.io`` is compat.mori, whichever was imported first."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter, with ``tmp_path`` (fake modules) and this checkout importable."""
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=60
    )


@pytest.fixture
def consumer(tmp_path: Path) -> Path:
    """A module that imports mori.io the way vLLM's MoRIIO modules do, remembering a failure."""
    (tmp_path / "consumer.py").write_text(
        textwrap.dedent(
            """
            try:
                from mori.io import IOEngine, IOEngineConfig
                enabled = True
            except ImportError:
                enabled = False
            """
        )
    )
    return tmp_path


def test_a_module_imported_after_the_alias_binds_compat_names(consumer: Path) -> None:
    out = run(
        """
        from moriio_async.integrations import mori_alias
        assert mori_alias.install() and mori_alias.installed()
        import consumer, mori.io
        from moriio_async.compat import mori as compat
        assert consumer.enabled and consumer.IOEngine is compat.IOEngine and mori.io is compat
        print("ok")
        """,
        consumer,
    )
    assert out.stdout.strip() == "ok", out.stderr


def test_a_module_imported_before_the_alias_is_imported_again(consumer: Path) -> None:
    out = run(
        """
        import consumer
        assert not consumer.enabled
        from moriio_async.integrations import mori_alias
        mori_alias.install()
        assert mori_alias.reload_failed(["consumer", "never_imported"]) == ["consumer"]
        from moriio_async.compat import mori as compat
        assert consumer.enabled and consumer.IOEngine is compat.IOEngine
        assert mori_alias.reload_failed(["consumer"]) == []  # bound now: not reloaded twice
        print("ok")
        """,
        consumer,
    )
    assert out.stdout.strip() == "ok", out.stderr


def test_a_real_mori_package_is_kept_unless_forced(consumer: Path) -> None:
    real = consumer / "mori"
    real.mkdir()
    (real / "__init__.py").write_text("REAL = True\n")
    (real / "io.py").write_text("class IOEngine: pass\nclass IOEngineConfig: pass\n")
    out = run(
        """
        from moriio_async.integrations import mori_alias
        assert not mori_alias.install() and not mori_alias.installed()
        import consumer, mori
        assert consumer.enabled and mori.REAL
        assert mori_alias.install(force=True) and mori_alias.installed()
        print("ok")
        """,
        consumer,
    )
    assert out.stdout.strip() == "ok", out.stderr
