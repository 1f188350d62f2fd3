"""Two `sluice serve` processes share sliding-window slots, driven by the `openai` SDK.

Both share one KV store (12 node processes + redis-server) for prefix blocks, and the store's
Redis as the SWA directory. A conversation's first turn runs on A; its second turn lands on
B, which loads the blocks from the store and A's slot from A (gRPC): no replay, and the text
of a cold engine. Then A is killed: its directory entries are gone within its lease, and B,
asked to continue another of A's conversations with bounded replay, answers from the store's
blocks and a 31-token replay.

Arithmetic (tiny preset: 4 layers, 32-token window, 256-token blocks): a 1,000-token first
turn leaves a slot at 1,000 tokens (3 full blocks + a 232-token tail) and 3 blocks in the
store; without the slot, an exact replay serves 768 - 124 tokens, a bounded one 768 - 31.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis

from engine.kvconnector.swa_directory import RedisSlotDirectory
from services.local.store import LocalStore
from tests.integration.api.test_cross_engine_store import metric, tokens, wait_metric
from tests.integration.serve_proc import ServeProcess, serve_side_by_side

pytestmark = [pytest.mark.integration, pytest.mark.timing]

FIRST = 1000
LEASE_S = 2.0


def complete(url: str, prompt: list[int], max_tokens: int, **extra: Any) -> Any:
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-unused", max_retries=0, timeout=180)
    return oai.completions.create(
        model="deepseek-chat", prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True, **extra},
    )  # fmt: skip


def hit(r: Any) -> int:
    return int((r.usage.model_extra or {})["prompt_cache_hit_tokens"])


def entries(url: str) -> list[Any]:
    """Every live entry of the directory (its anchors read from Redis)."""
    r = redis.Redis.from_url(url)
    anchors = [bytes.fromhex(k.decode().rsplit(":", 1)[1]) for k in r.scan_iter("sluice:swa:a:*")]
    r.close()
    d = RedisSlotDirectory(url)
    try:
        return d.locate(anchors)
    finally:
        d.close()


def wait(predicate, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def servers(
    tiny_model: Path, store: LocalStore, tmp_path_factory
) -> Iterator[tuple[ServeProcess, ServeProcess]]:
    assert store.redis is not None
    args = [
        "--model", str(tiny_model), "--store", str(store.spec_path), "--host-swa-mib", "64",
        "--swa-directory", store.redis.url, "--swa-lease-s", str(LEASE_S),
    ]  # fmt: skip
    homes = [tmp_path_factory.mktemp(f"home-{name}") for name in "ab"]
    with serve_side_by_side([args, args], homes) as (a, b):
        yield a, b


def test_the_next_turn_on_another_engine_continues_from_the_first_engines_slot(servers, store, cold_url):
    a, b = servers
    url = store.redis.url
    first = tokens(1, FIRST)
    complete(a.url, first, max_tokens=1)  # its slot stands at 1,000 tokens when it ends
    wait_metric(a.url, "sluice_kv_store_saved_blocks_total", FIRST // 256)
    wait(lambda: len(entries(url)) == 1, "A's slot in the directory")
    (a_entry,) = entries(url)

    second = first + tokens(2, 40)
    got = complete(b.url, second, max_tokens=8)
    assert hit(got) == FIRST  # 3 blocks from the store, the slot and its tail block from A
    assert metric(b.url, 'sluice_swa_slot_hits_total{where="host"}') == 1
    assert metric(b.url, "sluice_swa_slot_fetched_bytes_total") > 0
    assert {e.holder for e in entries(url)} >= {a_entry.holder}  # B published its copy too
    want = complete(cold_url, second, max_tokens=8)
    assert got.choices[0].text == want.choices[0].text

    # another conversation of A's, then A dies without a word
    other = tokens(3, FIRST)
    complete(a.url, other, max_tokens=1)
    wait_metric(a.url, "sluice_kv_store_saved_blocks_total", 2 * (FIRST // 256))
    wait(lambda: sum(e.holder == a_entry.holder for e in entries(url)) == 2, "A's second slot")
    killed = time.monotonic()
    a.proc.kill()
    a.proc.wait(timeout=30)
    wait(lambda: not any(e.holder == a_entry.holder for e in entries(url)), "A's entries to go", LEASE_S + 5)
    assert time.monotonic() - killed <= LEASE_S + 1.0
    saved = metric(b.url, "sluice_kv_store_saved_blocks_total")
    b_entries = set(entries(url))  # A's are gone: all B's (A's first slot and B's own turn)
    assert len(b_entries) == 2
    third = other + tokens(4, 300)  # 1,300 tokens: B computes a 4th and 5th block, approximately
    got = complete(b.url, third, max_tokens=8, swa_replay="bounded")
    assert hit(got) == 768 - 31 and (got.usage.model_extra or {}).get("swa_replay") == "bounded"
    # nothing computed from the approximate state left B: no block to the store, no slot in
    # the directory (B's entries are still the two of the first conversation)
    time.sleep(1.0)
    assert metric(b.url, "sluice_kv_store_saved_blocks_total") == saved
    assert set(entries(url)) == b_entries
