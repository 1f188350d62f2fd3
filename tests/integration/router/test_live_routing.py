"""The router's policies serve live HTTP traffic: real API servers, 3 in-process engine
replicas of the tiny checkpoint each, driven by the official ``openai`` SDK.

Prompts are token-id lists on ``/v1/completions``, so the prefix each request shares with
the others is exact. The tiny model has 4 layers and a 32-token window, so a prefix-cache
hit of k full 256-token blocks serves ``256 k - 4 * 31`` prompt tokens (the exact-replay
rule of docs/engine-runtime.md); a 3-block shared prefix gives 644 hit tokens.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
import pytest

from costmodel import CostModel
from services.api.config import ApiConfig
from services.api.inprocess import InProcessEngineClient
from services.api.server import ServerThread
from services.routing.client import RoutedEngineClient, RoutingConfig
from tests.integration.serve_proc import ServeProcess

pytestmark = pytest.mark.integration

BLOCK = 256
REPLAY = 4 * (32 - 1)  # tiny: layers x (window - 1)
PREFIX_BLOCKS = 3


@dataclass
class Served:
    url: str
    engine: RoutedEngineClient | InProcessEngineClient

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def tiny(checkpoint_factory):
    return checkpoint_factory("tiny")


@pytest.fixture(scope="module")
def cpu_cost_model(tmp_path_factory) -> str:
    """The tiny checkpoint's prefill cost on this 2-core CPU while other work shares it, roughly
    (a 900-token prefill takes 0.35 s alone, about 1 s with three busy replicas)."""
    path = tmp_path_factory.mktemp("cost") / "cost.json"
    path.write_text(CostModel(a=0.0, b=0.0, c=0.005, d=1e-3).to_json())
    return str(path)


def _serve(engine) -> Iterator[Served]:
    from services.api.app import create_app

    app = create_app(ApiConfig(max_concurrency=8, max_queue=16), engine)
    with ServerThread(app, app.state.sluice.config) as srv:
        yield Served(srv.url, engine)


def _routed(tiny, policy: str, cost_path: str) -> Iterator[Served]:
    from pathlib import Path

    cfg = RoutingConfig(replicas=3, policy=policy, cost_model_path=Path(cost_path))
    yield from _serve(RoutedEngineClient.in_process(tiny, cfg))


@pytest.fixture(scope="module")
def sluice_server(tiny, cpu_cost_model) -> Iterator[Served]:
    yield from _routed(tiny, "sluice", cpu_cost_model)


@pytest.fixture(scope="module")
def rr_server(tiny, cpu_cost_model) -> Iterator[Served]:
    yield from _routed(tiny, "round_robin", cpu_cost_model)


def prompts_sharing_a_prefix(seed: int, n: int, suffix: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(2, 1000) for _ in range(PREFIX_BLOCKS * BLOCK)]
    return [prefix + [rng.randrange(2, 1000) for _ in range(suffix)] for _ in range(n)]


def complete(served: Served, prompt: list[int], **kw):
    return served.client().completions.create(
        model="deepseek-chat", prompt=prompt, max_tokens=kw.pop("max_tokens", 2), temperature=0, **kw
    )


def hit_tokens(resp) -> int:
    hit = (resp.usage.model_extra or {})["prompt_cache_hit_tokens"]
    assert resp.usage.prompt_tokens_details.cached_tokens == hit
    return int(hit)


def routed_delta(engine: RoutedEngineClient, before: list[int]) -> list[int]:
    return [a - b for a, b in zip(engine.routed, before)]


def test_sluice_sends_a_shared_prefix_to_the_replica_that_caches_it(sluice_server):
    engine = sluice_server.engine
    before = list(engine.routed)
    hits = [hit_tokens(complete(sluice_server, p)) for p in prompts_sharing_a_prefix(1, 4)]
    delta = routed_delta(engine, before)
    assert sorted(delta) == [0, 0, 4], delta  # all four followed the first
    assert hits[0] == 0 and hits[1:] == [PREFIX_BLOCKS * BLOCK - REPLAY] * 3, hits
    replica = delta.index(4)
    assert engine.router.index.engine_blocks(replica) >= PREFIX_BLOCKS  # fed by its cache events


def test_round_robin_scatters_the_same_sequence_and_gets_fewer_hits(rr_server, sluice_server):
    engine = rr_server.engine
    before = list(engine.routed)
    hits = [hit_tokens(complete(rr_server, p)) for p in prompts_sharing_a_prefix(1, 4)]
    assert sorted(routed_delta(engine, before)) == [1, 1, 2]
    # the first three land on three different replicas: only the fourth finds the prefix
    assert hits[:3] == [0, 0, 0] and sum(hits) < 3 * (PREFIX_BLOCKS * BLOCK - REPLAY)


def test_sluice_spreads_distinct_prefixes_over_replicas(sluice_server):
    engine = sluice_server.engine
    before = list(engine.routed)
    prompts = [prompts_sharing_a_prefix(100 + i, 1)[0] for i in range(3)]
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda p: complete(sluice_server, p), prompts))
    assert all(r.choices[0].finish_reason in ("length", "stop") for r in results)
    delta = routed_delta(engine, before)
    assert sum(delta) == 3 and max(delta) < 3, delta  # concurrent distinct work is not stacked


def test_metrics_report_per_replica_routing_and_hits(sluice_server):
    for p in prompts_sharing_a_prefix(7, 2):
        complete(sluice_server, p)
    text = httpx.get(f"{sluice_server.url}/metrics", timeout=30).text
    engine = sluice_server.engine
    for i in range(3):
        m = re.search(rf'sluice_router_routed_requests_total{{policy="sluice",replica="{i}"}} (\S+)', text)
        assert m and float(m.group(1)) == engine.routed[i], text[:2000]
        m = re.search(rf'sluice_router_prefix_hit_tokens_total{{policy="sluice",replica="{i}"}} (\S+)', text)
        assert m and float(m.group(1)) == engine.hit_tokens[i]
        assert f'sluice_router_replica_up{{replica="{i}"}} 1.0' in text
    assert sum(engine.hit_tokens) >= PREFIX_BLOCKS * BLOCK - REPLAY


def test_greedy_output_through_the_router_equals_one_engine(tiny, sluice_server):
    prompt = prompts_sharing_a_prefix(11, 1, suffix=7)[0]
    routed = complete(sluice_server, prompt, max_tokens=8)
    streamed = list(
        sluice_server.client().completions.create(
            model="deepseek-chat", prompt=prompt, max_tokens=8, temperature=0, stream=True
        )
    )
    single_gen = _serve(InProcessEngineClient(tiny))
    single = next(single_gen)
    try:
        alone = complete(single, prompt, max_tokens=8)
    finally:
        single_gen.close()
    assert routed.choices[0].text == alone.choices[0].text
    assert "".join(c.choices[0].text for c in streamed if c.choices) == alone.choices[0].text
    assert routed.usage.completion_tokens == alone.usage.completion_tokens


def _idle(engine: InProcessEngineClient) -> bool:
    s = engine.stats()
    return s.running == 0 and s.waiting == 0 and s.extra["free_swa_slots"] == s.extra["total_swa_slots"]


def wait_for(predicate, timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)


def test_stream_disconnect_aborts_on_the_replica_that_ran_it(sluice_server):
    engine = sluice_server.engine
    replicas = engine.replicas
    for r in replicas:
        wait_for(lambda r=r: _idle(r), what="idle replicas")
    before_routed = list(engine.routed)
    before_aborts = [r.stats().aborted_total for r in replicas]
    body = {
        "model": "deepseek-chat",
        "prompt": prompts_sharing_a_prefix(23, 1)[0],
        "max_tokens": 3000,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,  # still in flight when the client goes away, whatever the weights
    }
    client = httpx.Client(base_url=sluice_server.url, timeout=60)
    with client, client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()  # kept: dropping it would close the stream before the asserts
        data = [ln for _, ln in zip(range(200), lines) if ln.startswith("data: ")][:5]
        assert len(data) == 5
        (target,) = [i for i, d in enumerate(routed_delta(engine, before_routed)) if d]
        assert replicas[target].stats().running == 1
    wait_for(lambda: _idle(replicas[target]), what="the aborted request's slot and blocks back")
    aborts = [r.stats().aborted_total - b for r, b in zip(replicas, before_aborts)]
    assert aborts == [int(i == target) for i in range(3)], aborts
    assert not engine._where and not any(engine._prefilling)  # the router forgot it too
    assert engine.router.prefill.outstanding[target] == 0


def test_abort_by_id_reaches_the_replica_that_holds_the_request(sluice_server):
    import asyncio

    engine = sluice_server.engine
    replicas = engine.replicas
    for r in replicas:
        wait_for(lambda r=r: _idle(r), what="idle replicas")
    wait_for(lambda: not engine._where, what="earlier tests' requests to leave the router")
    before_aborts = [r.stats().aborted_total for r in replicas]
    body = {
        "model": "deepseek-chat",
        "prompt": [2, 3, 4, 5],
        "max_tokens": 3000,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,  # greedy, the tiny model's EOS comes after ~300 tokens: not in flight then
    }
    client = httpx.Client(base_url=sluice_server.url, timeout=60)
    with client, client.stream("POST", "/v1/completions", json=body) as resp:
        # One line iterator for the whole block: a dropped iter_lines() generator closes the
        # response, and the server would abort the request as a client disconnect.
        lines = resp.iter_lines()
        data = [ln for _, ln in zip(range(50), lines) if ln.startswith("data: ")][:3]
        assert len(data) == 3
        in_flight = list(engine._where.items())
        assert len(in_flight) == 1, f"not in flight after 3 chunks: {data}; {[r.stats() for r in replicas]}"
        ((rid, target),) = in_flight
        asyncio.run_coroutine_threadsafe(engine.abort(rid), replicas[0]._loop).result(10)
        wait_for(
            lambda: replicas[target].stats().aborted_total == before_aborts[target] + 1, what="the abort"
        )
        assert [r.stats().aborted_total - b for r, b in zip(replicas, before_aborts)] == [
            int(i == target) for i in range(3)
        ]
        asyncio.run_coroutine_threadsafe(engine.abort("no-such-request"), replicas[0]._loop).result(
            10
        )  # no-op
    wait_for(lambda: _idle(replicas[target]), what="the aborted request's slot back")


def test_the_index_mirrors_each_replicas_cache_from_its_events(rr_server):
    """round_robin never inserts blocks itself: what the index holds came from cache events,
    including blocks the engine filled with generated tokens (no router could guess them)."""
    engine = rr_server.engine
    prompt = prompts_sharing_a_prefix(31, 1, suffix=0)[0][: 2 * BLOCK + 100]
    complete(rr_server, prompt, max_tokens=200)  # the third block: prompt tail + output
    complete(rr_server, [5])  # any request makes the router drain the events
    for i, r in enumerate(engine.replicas):
        cached = r._core.cached_hashes()
        assert engine.router.index.engine_blocks(i) == len(cached), i
    owner = max(range(3), key=lambda i: len(engine.replicas[i]._core.cached_hashes()))
    assert engine.router.index.engine_blocks(owner) >= 3
    # the router's own hashing of the prompt names exactly the blocks the engine reported
    import asyncio

    from services.api.engine_client import EngineRequest

    view = asyncio.run(engine._view(EngineRequest("probe", tuple(prompt), 1)))
    assert len(view.blocks) == 2
    assert engine.router.index.match(view.blocks).tolist() == [2 if i == owner else 0 for i in range(3)]


@pytest.fixture()
def pair_server(tiny, cpu_cost_model) -> Iterator[Served]:
    from pathlib import Path

    cfg = RoutingConfig(replicas=2, policy="least_load", cost_model_path=Path(cpu_cost_model))
    yield from _serve(RoutedEngineClient.in_process(tiny, cfg))


def test_a_replica_that_is_down_is_skipped_and_none_up_is_503(pair_server):
    import asyncio

    engine = pair_server.engine
    first, second = engine.replicas

    def stop(replica) -> None:
        asyncio.run_coroutine_threadsafe(replica.close(), replica._loop).result(30)

    stop(first)
    before = list(engine.routed)
    for k in range(3):
        assert complete(pair_server, [2, 3, 4 + k]).choices[0].finish_reason in ("length", "stop")
    assert routed_delta(engine, before) == [0, 3]
    text = httpx.get(f"{pair_server.url}/metrics", timeout=30).text
    assert 'sluice_router_replica_up{replica="0"} 0.0' in text
    assert httpx.get(f"{pair_server.url}/ready", timeout=30).status_code == 200
    stop(second)
    with pytest.raises(openai.APIStatusError) as err:
        complete(pair_server, [2, 3, 4])
    assert err.value.status_code == 503
    assert httpx.get(f"{pair_server.url}/ready", timeout=30).status_code == 503


def test_sluice_serve_with_replicas_routes_and_reports_them(tiny, tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "SLUICE_HOME": str(tmp_path), "SLUICE_LOG_LEVEL": "WARNING"}
    bad = subprocess.run(
        [sys.executable, "-m", "services.cli", "serve", "--port", "0", "--model", str(tiny), "--replicas", "0"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode != 0 and "replicas must be >= 1" in bad.stderr + bad.stdout
    server = ServeProcess(
        ["--model", str(tiny), "--replicas", "2", "--router-policy", "cache_aware"],
        {"SLUICE_HOME": str(tmp_path), "SLUICE_LOG_LEVEL": "WARNING"},
    )
    url = server.url
    try:
        server.wait_until_ready("/ready")
        body = {"model": "deepseek-chat", "prompt": [2, 3, 4], "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        text = httpx.get(f"{url}/metrics", timeout=10).text
        routed = re.findall(
            r'sluice_router_routed_requests_total{policy="cache_aware",replica="(\d)"} (\S+)', text
        )
        assert sorted(r for r, _ in routed) == ["0", "1"] and sum(float(v) for _, v in routed) == 1.0
    finally:
        server.stop()


def test_the_router_costs_a_hit_with_the_window_replay_the_request_will_run(sluice_server):
    """The tiny model: exact replay 4 x 31 tokens, bounded 31 (the replicas' ModelInfo)."""
    import asyncio

    from services.api.engine_client import EngineRequest

    engine = sluice_server.engine
    assert engine.model_info().swa_replay_tokens == (REPLAY, 31)

    def view(**kw):
        req = EngineRequest("v", tuple(range(2, 900)), 4, **kw)
        return asyncio.run_coroutine_threadsafe(engine._view(req), engine.replicas[0]._loop).result(10)

    assert view().swa_replay_tokens == REPLAY  # the deployment default: exact
    assert view(swa_replay="bounded").swa_replay_tokens == 31
    assert view(swa_replay="bounded").cached_tokens(3) == 3 * BLOCK - 31
