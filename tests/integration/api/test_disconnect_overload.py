"""Client disconnects free engine resources; overload is refused fast with Retry-After.

``small_server`` has 2 admission slots, 2 queue places and no prefix cache, so when no
request runs every KV block is free (a prefix cache would keep finished blocks cached).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytestmark = pytest.mark.integration

# The regex forbids ending (EOS) before 2000 characters, so random weights cannot stop early.
LONG = {
    "model": "deepseek-chat",
    "messages": [{"role": "user", "content": "Tell a long story."}],
    "max_tokens": 3000,
    "response_format": {"type": "regex", "regex": "[a-z ]{2000}"},
}


def wait_for(predicate, timeout_s: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)


def idle(engine) -> bool:
    s = engine.stats()
    slots_free = s.extra["free_swa_slots"] == s.extra["total_swa_slots"]
    return s.running == 0 and s.waiting == 0 and s.free_blocks == s.total_blocks and slots_free


def test_stream_disconnect_aborts_the_request_and_frees_its_blocks(small_server):
    engine = small_server.engine
    wait_for(lambda: idle(engine), what="an idle engine")
    before = engine.stats()
    client = httpx.Client(base_url=small_server.url, timeout=60)
    with client, client.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True}) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        data = [ln for _, ln in zip(range(200), lines) if ln.startswith("data: ")][:20]
        assert len(data) >= 10
        during = engine.stats()
        assert during.running == 1 and during.free_blocks < during.total_blocks
        # leaving the block closes the connection mid-stream
    wait_for(lambda: idle(engine), what="the aborted request's blocks to be freed")
    after = engine.stats()
    assert after.aborted_total == before.aborted_total + 1
    assert after.finished_total == before.finished_total  # aborted, not run to max_tokens
    assert during.extra["free_swa_slots"] == after.extra["free_swa_slots"] - 1  # its slot came back


def test_non_streaming_disconnect_aborts_too(small_server):
    engine = small_server.engine
    wait_for(lambda: idle(engine), what="an idle engine")
    before = engine.stats()
    body = json.dumps(LONG).encode()
    host, port = small_server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_for(lambda: engine.stats().running == 1, what="the request to start generating")
    wait_for(lambda: idle(engine), what="the abandoned request's blocks to be freed")
    assert engine.stats().aborted_total == before.aborted_total + 1


def test_overload_gets_429_with_retry_after_while_admitted_requests_complete(small_server):
    cfg = small_server.config
    limit = cfg.max_concurrency + cfg.max_queue
    body = {"model": "deepseek-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40}
    start = threading.Barrier(2 * limit)

    def one(_: int) -> tuple[int, float, str | None, int]:
        with httpx.Client(base_url=small_server.url, timeout=120) as c:
            start.wait(30)
            t0 = time.monotonic()
            r = c.post("/v1/chat/completions", json=body)
            tokens = r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0
            return r.status_code, time.monotonic() - t0, r.headers.get("retry-after"), tokens

    with ThreadPoolExecutor(2 * limit) as pool:
        results = list(pool.map(one, range(2 * limit)))
    ok = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] in (429, 503)]
    assert len(ok) == limit and len(refused) == limit, results
    assert all(r[2] == str(cfg.retry_after_s) for r in refused)
    assert all(r[1] < 1.0 for r in refused), [r[1] for r in refused]  # answered fast
    assert all(0 < r[3] <= 40 for r in ok)
    assert max(r[1] for r in ok) > max(r[1] for r in refused)  # refused while others still ran


def test_engine_not_running_is_503_and_not_ready(tiny_model):
    """The real client, never started (no lifespan): /ready and generation say 503."""
    from services.api.app import create_app
    from services.api.config import ApiConfig
    from services.api.inprocess import InProcessEngineClient

    app = create_app(ApiConfig(), InProcessEngineClient(tiny_model))

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            ready = await c.get("/ready")
            gen = await c.post("/v1/chat/completions", json={**LONG, "max_tokens": 5})
            return ready, gen

    ready, gen = asyncio.run(scenario())
    assert ready.status_code == 503 and ready.headers["retry-after"]
    assert gen.status_code == 503 and gen.headers["retry-after"] == "1"
    assert gen.json()["error"]["code"] == "engine_unavailable"


def test_disconnect_churn_leaves_the_engine_idle_and_serving(small_server):
    """Many clients leaving at different points (before and after the first token) in
    parallel: every request is aborted or finished, nothing leaks, the engine still serves."""
    engine = small_server.engine
    wait_for(lambda: idle(engine), what="an idle engine")
    before = engine.stats()
    body = {**LONG, "stream": True}

    def worker(w: int) -> None:
        for i in range(5):
            with httpx.Client(base_url=small_server.url, timeout=60) as c:
                try:
                    with c.stream("POST", "/v1/chat/completions", json=body) as r:
                        for j, _ in enumerate(r.iter_lines()):
                            if j >= ((w + i) % 4) * 3:
                                break
                except httpx.HTTPError:
                    pass

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    wait_for(lambda: idle(engine), timeout_s=30, what="every abandoned request to be freed")
    after = engine.stats()
    admitted = after.requests_total - before.requests_total
    assert admitted > 0 and after.aborted_total - before.aborted_total == admitted  # none ran to the end
    with httpx.Client(base_url=small_server.url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json={**LONG, "max_tokens": 3, "response_format": None})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
