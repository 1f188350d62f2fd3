"""``sluice serve`` as a user runs it: a subprocess on a free loopback port, then curl-like calls."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from services.procs import free_port
from tests.integration.serve_proc import stop, wait_until_ready

pytestmark = pytest.mark.integration


def test_sluice_serve_starts_answers_and_stops(tiny_model, tmp_path):
    port = free_port()
    env = {
        **os.environ,
        "SLUICE_HOME": str(tmp_path),
        "SLUICE_API_KEYS": "sk-serve-test",
        "SLUICE_LOG_LEVEL": "WARNING",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve", "--port", str(port), "--model", str(tiny_model)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_ready(proc, url, "/health")
        headers = {"authorization": "Bearer sk-serve-test"}
        body = {"model": "deepseek-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code == 401
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4
        assert httpx.get(f"{url}/ready", headers=headers, timeout=10).status_code == 200
    finally:
        stop(proc)
    assert proc.returncode in (0, -15)


@pytest.mark.slow
def test_default_model_is_generated_on_first_use(tmp_path, monkeypatch):
    from services.commands.serve import default_model_dir

    monkeypatch.setenv("SLUICE_HOME", str(tmp_path))
    monkeypatch.delenv("SLUICE_MODEL_DIR", raising=False)
    path = default_model_dir()
    assert path == tmp_path / "checkpoints" / "tiny" and (path / "tokenizer.json").is_file()
    mtime = (path / "config.json").stat().st_mtime
    assert default_model_dir() == path and (path / "config.json").stat().st_mtime == mtime  # not regenerated
