"""``sluice serve`` as a user runs it: a subprocess on a free loopback port, then curl-like calls."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import httpx
import pytest

from tests.integration.serve_proc import ServeProcess

pytestmark = pytest.mark.integration


def test_sluice_serve_starts_answers_and_stops(tiny_model, tmp_path):
    env = {"SLUICE_HOME": str(tmp_path), "SLUICE_API_KEYS": "sk-serve-test", "SLUICE_LOG_LEVEL": "WARNING"}
    server = ServeProcess(["--model", str(tiny_model)], env)
    try:
        url = server.url
        assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
        server.wait_until_ready("/health")
        headers = {"authorization": "Bearer sk-serve-test"}
        body = {"model": "deepseek-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code == 401
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4
        assert httpx.get(f"{url}/ready", headers=headers, timeout=10).status_code == 200
    finally:
        server.stop()
    assert server.returncode in (0, -15)


def test_a_taken_port_is_a_clear_error_before_the_model_loads(tmp_path):
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "services.cli", "serve", "--port", str(port), "--model", str(tmp_path / "none")],
            env={**os.environ, "SLUICE_HOME": str(tmp_path)},
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert out.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr + out.stdout


@pytest.mark.slow
def test_default_model_is_the_trained_preset_and_random_ones_are_generated_once(tmp_path, monkeypatch):
    from engine.checkpoint.presets import SHIPPED
    from services.commands.serve import default_model_dir, preset_dir

    monkeypatch.setenv("SLUICE_HOME", str(tmp_path))
    monkeypatch.delenv("SLUICE_MODEL_DIR", raising=False)
    assert default_model_dir() == SHIPPED["trained"] and not (tmp_path / "checkpoints").exists()
    path = preset_dir("tiny")
    assert path == tmp_path / "checkpoints" / "tiny" and (path / "tokenizer.json").is_file()
    mtime = (path / "config.json").stat().st_mtime
    assert preset_dir("tiny") == path and (path / "config.json").stat().st_mtime == mtime  # not regenerated
