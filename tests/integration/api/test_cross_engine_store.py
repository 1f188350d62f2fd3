"""Two real ``sluice serve`` processes sharing one KV store (12 node processes + redis-server).

The headline: a ~4,000-token prompt answered by server A is, with a different last sentence,
answered by server B mostly from A's blocks in the store (``usage.prompt_cache_hit_tokens``),
with the same greedy text as a cold engine. And the store's failures show on ``/metrics``.

Arithmetic (tiny preset: 4 layers, sliding window 32, 256-token blocks): blocks from the
store carry no sliding-window state, so B replays ``4 * (32 - 1) = 124`` tokens before them.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from services.local.store import LocalStore
from tests.integration.serve_proc import ServeProcess, serve_side_by_side

# slow: two API servers over a 12-node store (~40 s on 2 cores); `make test-slow` runs it. The
# store's cross-engine hit stays in make test at the engine level (test_store_connector.py).
pytestmark = [pytest.mark.integration, pytest.mark.slow]

BLOCK = 256
REPLAY = 4 * (32 - 1)  # num_hidden_layers * (sliding_window - 1) of the tiny preset
PROMPT_TOKENS = 4000
SHARED = 3900  # then B's prompt ends differently: TAIL other tokens
TAIL = 120
MAX_TOKENS = 8
MODEL = "deepseek-chat"


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def metric(url: str, name: str) -> float:
    """One unlabelled sample of ``url``'s /metrics (0 when absent)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def wait_metric(url: str, name: str, at_least: float, timeout_s: float = 30.0) -> float:
    deadline = time.monotonic() + timeout_s
    while (value := metric(url, name)) < at_least:
        assert time.monotonic() < deadline, f"{name} stayed at {value} (< {at_least}) for {timeout_s:.0f} s"
        time.sleep(0.1)
    return value


def complete(url: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> Any:
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-unused", max_retries=0, timeout=180)
    return oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
    )


def hit_tokens(r: Any) -> int:
    return int((r.usage.model_extra or {})["prompt_cache_hit_tokens"])


@pytest.fixture(scope="module")
def servers(
    tiny_model: Path, store: LocalStore, tmp_path_factory
) -> Iterator[tuple[ServeProcess, ServeProcess]]:
    """A and B: ``sluice serve --store SPEC --model tiny --port 0``, loading side by side."""
    args = ["--model", str(tiny_model), "--store", str(store.spec_path)]
    homes = [tmp_path_factory.mktemp(f"home-{name}") for name in "ab"]
    with serve_side_by_side([args, args], homes) as (a, b):
        yield a, b


def test_b_answers_a_prompt_with_another_ending_from_the_store(
    servers: tuple[ServeProcess, ServeProcess], cold_url: str
) -> None:
    a, b = servers
    prompt = tokens(1, PROMPT_TOKENS)
    first = complete(a.url, prompt)
    assert first.usage.prompt_tokens == PROMPT_TOKENS and hit_tokens(first) == 0
    # A's write-through of its 15 full blocks has finished once its counter says so.
    wait_metric(a.url, "sluice_kv_store_saved_blocks_total", PROMPT_TOKENS // BLOCK)

    other = prompt[:SHARED] + tokens(2, TAIL)
    got = complete(b.url, other)
    hit = hit_tokens(got)
    assert hit >= SHARED - BLOCK - REPLAY, hit  # 3900 - 256 - 124 = 3520
    assert hit == (SHARED // BLOCK) * BLOCK - REPLAY, hit  # all 15 shared blocks: 3840 - 124 = 3716
    assert metric(b.url, "sluice_kv_store_fetched_blocks_total") == SHARED // BLOCK
    want = complete(cold_url, other)
    assert hit_tokens(want) == 0
    assert got.choices[0].text == want.choices[0].text
    assert got.usage.completion_tokens == want.usage.completion_tokens == MAX_TOKENS


def test_metrics_show_a_failed_store_read(
    servers: tuple[ServeProcess, ServeProcess], store: LocalStore, cold_url: str
) -> None:
    a, b = servers
    prompt = tokens(3, 1500)
    saved = metric(a.url, "sluice_kv_store_saved_blocks_total")
    complete(a.url, prompt, max_tokens=1)  # A is idle right after: its counter must still move
    wait_metric(a.url, "sluice_kv_store_saved_blocks_total", saved + 1500 // BLOCK)
    failures = metric(b.url, "sluice_kv_store_fetch_failures_total")
    down = (0, 1, 2)  # every object has a shard on each of the 12 nodes: 3 down is past 10+2
    for i in down:
        store.cluster.kill(i)
    try:
        got = complete(b.url, prompt)
    finally:
        for i in down:
            store.cluster.restart(i)
    assert hit_tokens(got) == 0
    assert metric(b.url, "sluice_kv_store_fetch_failures_total") == failures + 1
    assert got.choices[0].text == complete(cold_url, prompt).choices[0].text
    deadline = time.monotonic() + 5
    while "KV store read failed" not in b.output():
        assert time.monotonic() < deadline, b.output()[-3000:]
        time.sleep(0.1)
