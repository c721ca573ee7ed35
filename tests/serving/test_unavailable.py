"""A proxy with no healthy instance answers 503 in OpenAI's error shape, and says why."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import httpx
import openai
import pytest

from .fleet import MODEL, MODEL_FLAGS, env


def test_no_healthy_instance_is_a_clear_503() -> None:
    dead = "http://127.0.0.1:9"  # nothing listens on the discard port
    argv = [sys.executable, "-m", "moriio_async.serving", "proxy", "--port", "0", "--prefill", dead]
    argv += ["--decode", dead, *MODEL_FLAGS]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env())
    assert proc.stdout is not None
    try:
        url = json.loads(proc.stdout.readline())["url"]
        health = httpx.get(f"{url}/health", timeout=5)
        assert health.status_code == 503 and health.json()["ready"] is False
        assert all(not i["healthy"] and "health check failed" in i["reason"] for i in health.json()["instances"])
        with (
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30) as c,
            pytest.raises(openai.InternalServerError) as err,
        ):
            c.completions.create(model=MODEL.name, prompt="hello", max_tokens=4)
        assert err.value.status_code == 503 and err.value.code == "no_healthy_instance"
        assert "no healthy prefill instance" in err.value.message
        streamed = httpx.post(
            f"{url}/v1/completions", json={"model": MODEL.name, "prompt": "hi", "max_tokens": 2, "stream": True}
        )
        assert streamed.status_code == 503 and streamed.json()["error"]["code"] == "no_healthy_instance"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
        proc.stdout.close()
