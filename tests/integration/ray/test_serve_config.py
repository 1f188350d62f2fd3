"""``sluice serve --config FILE`` in local-cluster mode, as a user runs it: a subprocess that
starts Ray on loopback, one prefill and one decode engine actor, 12 store nodes and Redis,
and the API; driven through the ``openai`` SDK, then stopped with SIGTERM."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.integration.serve_proc import ServeProcess
from tests.integration.services.test_local_services import LOOPBACK_PREFIXES, _pids_of_tree, _sockets_of

pytestmark = pytest.mark.integration

READY_BOUND_S = 90.0  # what `make run` promises on this shape


def _spec(model) -> str:
    return f"""
mode: local-cluster
model: {model}
router_policy: sluice
api: {{host: 127.0.0.1, port: 8000, max_concurrency: 4, max_queue: 8}}
prefill: {{replicas: 1, expert_parallel: 1, chunk_token_budget: 512}}
decode: {{replicas: 1, expert_parallel: 1, max_running_requests: 8}}
store: {{nodes: 12, data_shards: 10, parity_shards: 2, capacity_bytes: 1073741824}}
"""


@pytest.mark.slow  # make test-slow: keeps make test under 15 minutes on 2 cores (~30 s)
def test_serve_config_brings_the_stack_up_answers_and_stops_cleanly(model, tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(_spec(model))
    started = time.monotonic()
    server = ServeProcess(["--config", str(path)], {"SLUICE_HOME": str(tmp_path), "SLUICE_LOG_LEVEL": "INFO"})
    try:
        server.wait_until_ready("/ready", READY_BOUND_S)
        ready_s = time.monotonic() - started
        assert ready_s < READY_BOUND_S
        tree = _pids_of_tree(server.proc.pid)
        addrs = _sockets_of(tree)
        assert len(addrs) >= 1 + 12 + 1 + 2, addrs  # API, store nodes, Redis, Ray
        assert [a for a in addrs if not a.startswith(LOOPBACK_PREFIXES)] == []
        oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120, max_retries=0)
        prompt = [{"role": "user", "content": "shared prefix " * 150 + "one"}]
        first = oai.chat.completions.create(
            model="deepseek-chat", messages=prompt, max_tokens=8, temperature=0
        )
        assert first.choices[0].finish_reason in ("length", "stop") and first.usage.completion_tokens >= 1
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert 'sluice_decode_placed_requests_total{engine="decode-0"} 1.0' in metrics, metrics[-2000:]
        assert "serving" in server.output() and "1 prefill and 1 decode engine(s) on Ray" in server.output()
        # SIGTERM drains: a stream in flight runs to its end, new connections are refused
        stream = oai.completions.create(
            model="deepseek-chat", prompt="drain me", max_tokens=200, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = iter(stream)
        next(chunks)
        server.proc.terminate()
        rest = list(chunks)
        assert rest[-1].choices[0].finish_reason == "length"
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{server.url}/health", timeout=2)
    finally:
        server.stop()
    assert server.proc.returncode in (0, -15), server.output()
    deadline = time.monotonic() + 30
    while _pids_of_tree_alive(tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _pids_of_tree_alive(tree), "Ray, store nodes or Redis outlived the server"


def _pids_of_tree_alive(pids: set[int]) -> set[int]:
    import os

    alive = set()
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.add(pid)
    return alive


@pytest.mark.slow  # ~40 s: a second stack, two API processes
def test_api_replicas_share_the_port_and_route_over_the_same_engines(model, tmp_path):
    """``api.replicas: 2``: two API processes accept on one socket, each with its own router
    over the same engine actors (found by name, followed by their own watch streams); both
    serve, answers equal, and SIGTERM stops both and everything else."""
    import re
    from concurrent.futures import ThreadPoolExecutor

    from tests.conftest import listening_sockets

    path = tmp_path / "cluster.yaml"
    path.write_text(_spec(model).replace("max_queue: 8}", "max_queue: 8, replicas: 2}"))
    server = ServeProcess(["--config", str(path)], {"SLUICE_HOME": str(tmp_path), "SLUICE_LOG_LEVEL": "INFO"})
    try:
        server.wait_until_ready("/ready", READY_BOUND_S)
        port = server.url.rsplit(":", 1)[1]
        owners = [proc for addr, proc in listening_sockets() if addr.endswith(f":{port}")]
        assert len(set(re.findall(r"pid=(\d+)", " ".join(owners)))) == 2, owners

        def chat(k: int) -> str:  # a new client each time: a new connection, accepted by either process
            oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120, max_retries=0)
            answer = oai.chat.completions.create(
                model="deepseek-chat", messages=[{"role": "user", "content": "same question"}],
                max_tokens=6, temperature=0,
            )  # fmt: skip
            return answer.choices[0].message.content

        def routing_pids() -> set[str]:
            return set(
                re.findall(r"services\.ray\.replica\[(\d+)\]: request \S+: prefill on", server.output())
            )

        answers: list[str] = []
        with ThreadPoolExecutor(4) as pool:
            for _ in range(8):  # bounded: until both processes have routed requests
                answers += pool.map(chat, range(4))
                if len(routing_pids()) == 2:
                    break
        assert len(routing_pids()) == 2, server.output()[-3000:]
        assert len(set(answers)) == 1, answers  # greedy: every process's answer is the same
        tree = _pids_of_tree(server.proc.pid)
        server.proc.terminate()
        server.proc.wait(60)
    finally:
        server.stop()
    deadline = time.monotonic() + 30
    while _pids_of_tree_alive(tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _pids_of_tree_alive(tree), "an API replica, Ray, store nodes or Redis outlived the server"
