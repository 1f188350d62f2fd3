"""The router learns the KV store from its engines: 2 in-process replicas of the tiny
checkpoint behind ``RoutedEngineClient`` (``sluice``), sharing a real 10+2 store
(``services.local.store.LocalStore``: 12 node processes and a redis-server on loopback).

What is checked is what the router and a user see: the router's index reports the blocks a
replica wrote as store hits once the router has drained that replica (pushed by the engines,
not polled from Redis); a request sharing the prefix is served from cache on either replica,
from the store when the writer is gone, with greedy tokens equal to a cold engine's; and the
store fetch cost the policy prices a store hit at is the replicas' own measurement.

Arithmetic (tiny preset: 4 layers, window 32, 256-token blocks): a 2,000-token prompt has 7
full blocks; its variants keep the first 1,900 tokens, i.e. the same 7 blocks; a hit on
them that needs the exact sliding-window replay serves ``7 * 256 - 4 * 31 = 1668`` tokens.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from engine.core import CoreRequest, EngineConfig, EngineCore
from engine.sampling.params import SamplingParams
from engine.scheduler.hashing import chain_hashes
from services.api.engine_client import EngineRequest
from services.local.store import LocalStore
from services.routing.client import RoutedEngineClient, RoutingConfig

pytestmark = pytest.mark.integration

BLOCK = 256
PROMPT = 2000
SHARED = 1900
FULL = PROMPT // BLOCK  # 7 blocks, all within the shared part
STORE_HIT = FULL * BLOCK - 4 * (32 - 1)  # 1668
MAX_TOKENS = 8


def prompt_for(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(PROMPT)]


def variant(prompt: Sequence[int], seed: int) -> list[int]:
    rng = random.Random(seed)
    return [*prompt[:SHARED], *(rng.randrange(10, 1000) for _ in range(120))]


def cold_tokens(model: Path, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Greedy tokens of an engine with neither a store nor a prefix cache."""
    core = EngineCore(EngineConfig(model=str(model), enable_prefix_caching=False))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    out: list[list[int]] = []
    try:
        for n, prompt in enumerate(prompts):
            core.add(CoreRequest(f"cold{n}", tuple(prompt), params))
            tokens: list[int] = []
            done = False
            while not done:
                for o in core.step():
                    tokens += o.new_token_ids
                    done = done or o.finish_reason is not None
            out.append(tokens)
    finally:
        core.close()
    return out


async def ask(client: RoutedEngineClient, rid: str, prompt: Sequence[int]) -> tuple[int, list[int], int]:
    """(replica it was routed to, greedy tokens, prompt tokens reported as cached)."""
    before = list(client.routed)
    request = EngineRequest(rid, tuple(prompt), max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    tokens: list[int] = []
    cached = -1
    async for out in client.generate(request):
        tokens += out.token_ids
        if out.finish_reason is not None:
            cached = out.cached_tokens
    (engine,) = [i for i, (a, b) in enumerate(zip(before, client.routed)) if b > a]
    return engine, tokens, cached


@pytest.fixture(scope="module")
def store() -> Iterator[LocalStore]:
    with LocalStore() as st:
        yield st


def test_the_router_sees_what_a_replica_wrote_to_the_store_and_prices_it_as_measured(
    checkpoint_factory, store: LocalStore
) -> None:
    t0 = time.monotonic()
    model = checkpoint_factory("tiny")
    prompt = prompt_for(1)
    near, far = variant(prompt, 2), variant(prompt, 3)
    expected_near, expected_far = cold_tokens(model, [near, far])
    assert store.spec_path is not None

    async def go() -> None:
        client = RoutedEngineClient.in_process(
            model, RoutingConfig(replicas=2, policy="sluice"), kv_store=str(store.spec_path)
        )
        await client.start()
        try:
            await scenario(client)
        finally:
            await client.close()

    async def scenario(client: RoutedEngineClient) -> None:
        index = client.router.index
        block_size, extra = client.replicas[0].cache_identity()
        assert block_size == BLOCK
        shared = chain_hashes(near, BLOCK, extra)[:FULL]
        assert shared == chain_hashes(prompt, BLOCK, extra)[:FULL] == chain_hashes(far, BLOCK, extra)[:FULL]

        writer, _, cached = await ask(client, "first", prompt)
        other = 1 - writer
        assert cached == 0 and index.store_match(shared) == 0
        # the writer's blocks reach the store off its step's path, then the router at its next
        # drain (every request drains every replica first; a 10-token one fetches nothing)
        deadline = time.monotonic() + 30
        n = 0
        while index.store_match(shared) < FULL:
            assert time.monotonic() < deadline, (client.store_events, client.stats().extra)
            await asyncio.sleep(0.05)
            n += 1
            await ask(client, f"tiny{n}", [5] * 10)
        # the writer reports only blocks the store acknowledged (its ``kv_store_saved_blocks``
        # stat is a snapshot published after a step, so it can lag while the writer idles)
        assert client.store_events[writer] >= FULL and client.store_events[other] == 0
        # nothing was fetched yet, so nothing is measured: the policy ignores the store
        assert client.router.config.store_fetch_s_per_block is None

        # with the writer up, sluice keeps the prefix where it is cached locally
        engine, tokens, cached = await ask(client, "near", near)
        assert engine == writer and cached > 0 and tokens == expected_near

        # the writer goes away: the prefix is still a store hit, for the other replica
        await client.replicas[writer].close()
        engine, tokens, cached = await ask(client, "far", far)
        assert engine == other
        assert cached == STORE_HIT and tokens == expected_far
        fetched = client.replicas[other].stats().extra
        assert fetched["kv_store_fetched_blocks"] == FULL and fetched["kv_store_fetch_s_per_block"] > 0

        # the other replica's measurement becomes the policy's store fetch cost at the next drain
        await ask(client, "after", [6] * 10)
        measured = client.replicas[other].stats().extra["kv_store_fetch_s_per_block"]
        assert client.router.config.store_fetch_s_per_block == pytest.approx(measured)
        assert client.router.prefill.config.store_fetch_s_per_block == pytest.approx(measured)  # type: ignore[attr-defined]
        assert client.stats().extra["kv_store_fetch_s_per_block"] == pytest.approx(measured)

    asyncio.run(go())
    assert time.monotonic() - t0 < 120
