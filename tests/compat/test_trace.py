"""MORIIO_ASYNC_TRACE: one JSON line per posted status of a compat engine, written when the status ends."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from moriio_async.compat.mori import RdmaBackendConfig, StatusCode
from moriio_async.compat.mori.trace import TransferTrace

from .conftest import make_pair, register


def test_each_posted_status_is_one_line_in_its_engines_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "trace"  # made by the first engine that traces
    monkeypatch.setenv("MORIIO_ASYNC_TRACE", str(folder))
    a, b = make_pair("traced", "tcp")
    try:
        _, mx = register(a, 8192)
        _, my = register(b, 8192)
        session = a.create_session(mx, my)
        assert session is not None
        assert session.batch_write([0, 4096], [0, 4096], [1024, 512]).WaitFor(10_000) is StatusCode.SUCCESS
        assert session.read(0, 0, 100).WaitFor(10_000) is StatusCode.SUCCESS
        assert session.write(0, 8000, 300).Code() is StatusCode.ERR_INVALID_ARGS  # refused before posting: no line
        assert a.write(mx, 0, my, 0, 64).WaitFor(10_000) is StatusCode.SUCCESS  # engine-level: a line too
    finally:
        a.close()
        b.close()
    files = sorted(folder.iterdir())
    assert len(files) == 2 and all(f.suffix == ".jsonl" for f in files)  # one per engine
    lines = {f: [json.loads(line) for line in f.read_text().splitlines()] for f in files}
    (traced,) = [records for records in lines.values() if records]  # the target posted nothing
    assert [(r["engine"], r["op"], r["bytes"], r["code"], r["transport"]) for r in traced] == [
        (a.key, "write", 1536, 0, "tcp"),
        (a.key, "read", 100, 0, "tcp"),
        (a.key, "write", 64, 0, "tcp"),
    ]
    assert all(0 < r["t0"] <= r["t1"] for r in traced)


def test_a_posted_status_is_traced_with_notifications_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MORIIO_ASYNC_TRACE", str(tmp_path))
    a, b = make_pair("quiet", "tcp", RdmaBackendConfig(enable_notification=False))
    try:
        _, mx = register(a, 64)
        _, my = register(b, 64)
        assert a.write(mx, 0, my, 0, 64).WaitFor(10_000) is StatusCode.SUCCESS
    finally:
        a.close()
        b.close()
    records = [json.loads(line) for f in tmp_path.iterdir() for line in f.read_text().splitlines()]
    assert [(r["engine"], r["op"], r["bytes"], r["code"]) for r in records] == [(a.key, "write", 64, 0)]


def test_without_the_variable_nothing_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MORIIO_ASYNC_TRACE", "")
    monkeypatch.chdir(tmp_path)
    a, b = make_pair("untraced", "tcp")
    try:
        _, mx = register(a, 64)
        _, my = register(b, 64)
        assert a.write(mx, 0, my, 0, 64).WaitFor(10_000) is StatusCode.SUCCESS
    finally:
        a.close()
        b.close()
    assert list(tmp_path.iterdir()) == []


def test_a_line_is_on_disk_when_its_status_ends_before_the_engine_closes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The vLLM demo reads the traces of servers it SIGKILLs: a line must not wait in a buffer for close."""
    monkeypatch.setenv("MORIIO_ASYNC_TRACE", str(tmp_path))
    a, b = make_pair("live", "tcp")
    try:
        _, mx = register(a, 64)
        _, my = register(b, 64)
        assert a.write(mx, 0, my, 0, 64).WaitFor(10_000) is StatusCode.SUCCESS
        deadline = time.monotonic() + 5  # the line is written on the loop thread as the status ends
        while not (lines := [line for f in tmp_path.iterdir() for line in f.read_text().splitlines()]):
            assert time.monotonic() < deadline, "no line on disk while the engine runs"
            time.sleep(0.005)
        assert [(r["engine"], r["op"], r["bytes"]) for r in map(json.loads, lines)] == [(a.key, "write", 64)]
    finally:
        a.close()
        b.close()


def test_a_trace_names_its_file_and_once_closed_takes_no_more_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MORIIO_ASYNC_TRACE", str(tmp_path / "t"))
    trace = TransferTrace.from_env("e")
    assert trace is not None and trace.path.parent == tmp_path / "t" and trace.path.suffix == ".jsonl"
    trace.record(op="read", nbytes=8, code=0, t0=1.0, t1=2.0, transport="tcp")
    trace.close()
    trace.close()  # twice: nothing to close the second time
    trace.record(op="write", nbytes=8, code=0, t0=3.0, t1=4.0, transport="tcp")  # after close: dropped, no error
    (line,) = trace.path.read_text().splitlines()
    assert json.loads(line) == {"engine": "e", "op": "read", "bytes": 8, "code": 0, "t0": 1.0, "t1": 2.0,
                                "transport": "tcp"}  # fmt: skip
