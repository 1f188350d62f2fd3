"""The engine's KV connector against a real 10+2 store (12 node processes + redis-server).

Every test looks at what a user of the engine sees: the greedy tokens (always compared with
a cold engine that has neither a store nor a prefix cache), the prompt tokens reported as
cached, and the ``kv_store_*`` counters of ``EngineCore.stats().extra``.

Arithmetic used throughout (tiny preset: 4 layers, sliding window 32, 256-token blocks): a
block fetched from the store carries no sliding-window state, so the engine replays
``num_hidden_layers * (sliding_window - 1) = 4 * 31 = 124`` tokens before it; a prompt that
shares ``S`` tokens with one written earlier therefore reports at least
``S - 256 - 124`` cached tokens (``(S // 256) * 256 - 124`` exactly when the whole run is hit).
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from engine.core import CoreRequest, EngineConfig, EngineCore
from engine.kvconnector.payload import HEADER_BYTES_BLOCK
from engine.sampling.params import SamplingParams
from engine.scheduler.hashing import BlockHasher
from kvstore.shardfmt import HEADER_LEN
from kvstore.shardstore import shard_name
from kvstore.spec import StoreSpec, open_store_client
from kvstore.transport import GrpcShardTransport
from services.local.store import LocalStore

pytestmark = pytest.mark.integration

BLOCK = 256
PROMPT_TOKENS = 2000
SHARED = 1900  # tokens the second prompt shares with the first; then a different "last sentence"
TAIL = 120
MAX_TOKENS = 8
CONNECTOR_LOG = "engine.kvconnector.connector"
_ids = itertools.count()


# -- helpers ------------------------------------------------------------------------------
def prompt_for(seed: int, n: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def variant(prompt: Sequence[int], seed: int) -> list[int]:
    """The same prompt with a different ending: SHARED tokens kept, TAIL new ones."""
    rng = random.Random(seed + 10_000)
    return list(prompt[:SHARED]) + [rng.randrange(10, 1000) for _ in range(TAIL)]


def run(core: EngineCore, prompt: Sequence[int], max_tokens: int = MAX_TOKENS) -> tuple[list[int], int]:
    """Greedy tokens and the prompt tokens reported as cached, for one request."""
    rid = f"r{next(_ids)}"
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    core.add(CoreRequest(rid, tuple(prompt), params))
    tokens: list[int] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for out in core.step():
            if out.request_id == rid:
                assert out.error is None, out.error
                tokens += out.new_token_ids
                if out.finish_reason:
                    assert out.finish_reason == "length"
                    return tokens, out.cached_tokens
    raise AssertionError("request did not finish within 120 s")


def counters(core: EngineCore) -> dict[str, int]:
    return {
        k.removeprefix("kv_store_"): int(v)
        for k, v in core.stats().extra.items()
        if k.startswith("kv_store_")
    }


def replay_tokens(model: Path) -> int:
    cfg = json.loads((model / "config.json").read_text())
    return cfg["num_hidden_layers"] * (cfg["sliding_window"] - 1)


def hit_floor(model: Path) -> int:
    """Fewest cached tokens a store hit on SHARED shared tokens may report."""
    return SHARED - BLOCK - replay_tokens(model)


def block_hashes(core: EngineCore, prompt: Sequence[int]) -> list[bytes]:
    """The store keys of the prompt's full blocks, as this engine names them."""
    return list(BlockHasher(core.block_size, core.extra_keys).update(list(prompt)))


def node_index(store: LocalStore, node_id: str) -> int:
    return store.cluster.node_ids.index(node_id)


# -- fixtures -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(checkpoint_factory) -> Path:
    path = checkpoint_factory("tiny")
    assert replay_tokens(path) == 124  # 4 layers * (window 32 - 1): the figure the docstring uses
    return path


@pytest.fixture(scope="module")
def store() -> Iterator[LocalStore]:
    with LocalStore() as st:
        yield st


@pytest.fixture(scope="module")
def client(store: LocalStore) -> Iterator[Any]:
    """A store client of our own, to look at and tamper with what the engines wrote."""
    assert store.spec_path is not None
    c = open_store_client(StoreSpec.load(store.spec_path))
    yield c
    c.close()


@pytest.fixture(scope="module")
def cold(model: Path) -> Iterator[EngineCore]:
    """The reference: no store, no prefix cache, so every prompt is computed from scratch."""
    core = EngineCore(EngineConfig(model=str(model), enable_prefix_caching=False))
    yield core
    core.close()


@pytest.fixture()
def engines(model: Path) -> Iterator[Any]:
    """``make(spec_path=..., model=..., **config)``: fresh engines, closed after the test."""
    made: list[EngineCore] = []

    def make(spec_path: Path | None, model_dir: Path = model, **kw: Any) -> EngineCore:
        core = EngineCore(
            EngineConfig(model=str(model_dir), kv_store=str(spec_path) if spec_path else None, **kw)
        )
        made.append(core)
        return core

    yield make
    for core in made:
        core.close()


def write_through(engines: Any, spec_path: Path | None, prompt: list[int]) -> EngineCore:
    """Engine A answers ``prompt`` and its blocks reach the store."""
    a = engines(spec_path)
    run(a, prompt)
    assert a.store is not None and a.store.flush()
    full = len(prompt) // BLOCK
    assert counters(a)["saved_blocks"] == full, counters(a)
    return a


# -- tests --------------------------------------------------------------------------------
def test_cross_engine_hit(store: LocalStore, cold: EngineCore, engines: Any, model: Path) -> None:
    prompt = prompt_for(1)
    write_through(engines, store.spec_path, prompt)
    b = engines(store.spec_path)
    p2 = variant(prompt, 1)
    tokens, cached = run(b, p2)
    c = counters(b)
    assert cached >= hit_floor(model), (cached, c)
    assert cached == (SHARED // BLOCK) * BLOCK - replay_tokens(model)  # 7 blocks - 124 = 1668
    assert c["fetches"] == 1 and c["fetched_blocks"] == SHARED // BLOCK and c["fetch_failures"] == 0
    assert tokens == run(cold, p2)[0]


def test_two_nodes_down_still_hits(
    store: LocalStore, client: Any, cold: EngineCore, engines: Any, model: Path
) -> None:
    prompt = prompt_for(2)
    a = write_through(engines, store.spec_path, prompt)
    # The nodes of two *data* shards of the prompt's first object: the read needs parity.
    meta = client.directory.lookup_many(block_hashes(a, prompt)[:1])[0]
    down = [node_index(store, meta.nodes[0]), node_index(store, meta.nodes[5])]
    for i in down:
        store.cluster.kill(i)
    try:
        b = engines(store.spec_path)
        p2 = variant(prompt, 2)
        tokens, cached = run(b, p2)
        c = counters(b)
    finally:
        for i in down:
            store.cluster.restart(i)
    assert cached >= hit_floor(model), (cached, c)
    assert c["fetched_blocks"] == SHARED // BLOCK and c["fetch_failures"] == 0, c
    assert tokens == run(cold, p2)[0]


@pytest.mark.slow  # make test-slow: keeps make test under 15 minutes on 2 cores
def test_three_nodes_down_recomputes(
    store: LocalStore, client: Any, cold: EngineCore, engines: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=CONNECTOR_LOG)
    prompt = prompt_for(3)
    a = write_through(engines, store.spec_path, prompt)
    meta = client.directory.lookup_many(block_hashes(a, prompt)[:1])[0]
    down = [node_index(store, meta.nodes[i]) for i in (0, 1, 2)]
    for i in down:
        store.cluster.kill(i)
    try:
        b = engines(store.spec_path)
        p2 = variant(prompt, 3)
        before = counters(b)["fetch_failures"]
        tokens, cached = run(b, p2)
        c = counters(b)
    finally:
        for i in down:
            store.cluster.restart(i)
    assert cached == 0 and c["fetched_blocks"] == 0, (cached, c)
    assert c["fetch_failures"] == before + 1, c
    assert "KV store read failed" in caplog.text
    assert tokens == run(cold, p2)[0]


def test_redis_down_recomputes(cold: EngineCore, engines: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=CONNECTOR_LOG)
    prompt = prompt_for(4)
    with LocalStore() as own:
        write_through(engines, own.spec_path, prompt)
        b = engines(own.spec_path)
        assert own.redis is not None
        own.redis.stop()
        p2 = variant(prompt, 4)
        tokens, cached = run(b, p2)
        c = counters(b)
    assert cached == 0 and c["fetched_blocks"] == 0, (cached, c)
    assert c["fetch_failures"] == 1, c
    assert "KV store read failed" in caplog.text
    assert tokens == run(cold, p2)[0]


def test_bit_flip_in_a_stored_block_is_refused_and_recomputed(
    store: LocalStore,
    client: Any,
    cold: EngineCore,
    engines: Any,
    model: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=CONNECTOR_LOG)
    prompt = prompt_for(5)
    a = write_through(engines, store.spec_path, prompt)
    hashes = block_hashes(a, prompt)
    bad_at = 3
    good = bytes(client.get_prefix(hashes)[bad_at])
    bad = bytearray(good)
    bad[HEADER_BYTES_BLOCK + 1000] ^= 0x10  # one bit of the block's body
    client.delete([hashes[bad_at]])
    client.put_blocks([hashes[bad_at]], [bytes(bad)])
    try:
        assert bytes(client.get_prefix(hashes)[bad_at]) == bytes(bad)  # the store serves it
        b = engines(store.spec_path)
        tokens, cached = run(b, prompt)
        c = counters(b)
    finally:
        client.delete([hashes[bad_at]])  # leave no poisoned block behind
    assert c["corrupt_blocks"] == 1 and c["fetched_blocks"] == bad_at, c
    assert cached == bad_at * BLOCK - replay_tokens(model), cached  # 3 blocks - 124 = 644
    assert "refused" in caplog.text
    assert tokens == run(cold, prompt)[0]


def test_bit_flip_in_a_shard_file_is_rebuilt_from_parity(
    store: LocalStore, client: Any, cold: EngineCore, engines: Any, model: Path
) -> None:
    prompt = prompt_for(6)
    a = write_through(engines, store.spec_path, prompt)
    meta = client.directory.lookup_many(block_hashes(a, prompt)[:1])[0]
    node = store.cluster.nodes[node_index(store, meta.nodes[0])]  # holds data shard 0
    name = shard_name(meta.object_id, 0)
    path = store.cluster.data_dir(node_index(store, meta.nodes[0])) / "shards" / name[:1] / name
    raw = bytearray(path.read_bytes())
    raw[HEADER_LEN + 777] ^= 0x04  # one bit of the shard's payload; never read before, so not cached
    path.write_bytes(bytes(raw))
    t = GrpcShardTransport(node)
    try:
        corrupt_before = t.stats(2.0).corrupt_detected
        b = engines(store.spec_path)
        p2 = variant(prompt, 6)
        tokens, cached = run(b, p2)
        c = counters(b)
        assert t.stats(2.0).corrupt_detected == corrupt_before + 1  # the node's checksum caught it
        # ...and the reader's repair rewrote the shard from the others
        deadline = time.monotonic() + 15
        while True:
            try:
                t.get_shard(meta.object_id, 0, 2.0)
                break
            except Exception:
                assert time.monotonic() < deadline, "shard 0 was not rebuilt"
                time.sleep(0.1)
    finally:
        t.close()
    assert c["corrupt_blocks"] == 0 and c["fetched_blocks"] == SHARED // BLOCK, c
    assert cached >= hit_floor(model), cached
    assert tokens == run(cold, p2)[0]


@pytest.mark.slow  # make test-slow: keeps make test under 15 minutes on 2 cores
def test_fingerprint_isolation(
    store: LocalStore, checkpoint_factory, cold: EngineCore, engines: Any, model: Path, tmp_path: Path
) -> None:
    prompt = prompt_for(7)
    write_through(engines, store.spec_path, prompt)
    others = {
        "other weights": engines(store.spec_path, checkpoint_factory("tiny", seed=1)),
        "bfloat16": engines(store.spec_path, dtype="bfloat16"),
    }
    for what, core in others.items():
        _, cached = run(core, prompt)
        c = counters(core)
        assert cached == 0, what
        assert c["fetches"] == 1 and c["fetched_blocks"] == 0 and c["corrupt_blocks"] == 0, (what, c)
    copy = tmp_path / "renamed-copy"
    shutil.copytree(model, copy)
    same = engines(store.spec_path, copy)
    tokens, cached = run(same, prompt)
    assert cached == (PROMPT_TOKENS - 1) // BLOCK * BLOCK - replay_tokens(model), cached  # 1792 - 124
    assert counters(same)["fetched_blocks"] == (PROMPT_TOKENS - 1) // BLOCK
    assert tokens == run(cold, prompt)[0]


def test_write_through_to_a_dead_store_never_fails_the_step(cold: EngineCore, engines: Any) -> None:
    with LocalStore() as own:
        core = engines(own.spec_path)
        own.stop()  # every node and Redis: nothing answers any more
        results = []
        for seed in (8, 9):
            prompt = prompt_for(seed)
            t0 = time.monotonic()
            results.append((prompt, *run(core, prompt), time.monotonic() - t0))
    assert core.store is not None and core.store.flush()
    c = counters(core)
    for prompt, tokens, cached, _ in results:
        assert cached == 0
        assert tokens == run(cold, prompt)[0]
    full = 2 * (PROMPT_TOKENS // BLOCK)
    assert c["saved_blocks"] == 0 and c["save_failures"] + c["dropped_blocks"] == full, c
    assert c["fetch_failures"] == 2, c
