"""An import takes back the blocks that retained slots hold for prefix reuse, when it needs them.

Finished sequences keep their SWA slot and partial block for a later turn; those blocks are
a cache, not a reservation. Engine B below has all its free room in such blocks: the
import must evict them (it used to refuse with ``EngineFull``) and then continue exactly.
"""

from __future__ import annotations

import random

from engine.core import CoreRequest, EngineConfig, EngineCore
from engine.sampling.params import SamplingParams

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def prompt_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def finish(core: EngineCore, rid: str, tokens: list[int] | None = None) -> list[int]:
    out: list[int] = list(tokens or [])
    for _ in range(10_000):
        for o in core.step():
            if o.request_id == rid:
                out += o.new_token_ids
                if o.finish_reason is not None:
                    return out
    raise AssertionError(f"{rid} did not finish")


def test_import_evicts_retained_partial_blocks_it_needs(checkpoint_factory):
    model = str(checkpoint_factory("tiny"))
    a = EngineCore(EngineConfig(model=model))
    b = EngineCore(EngineConfig(model=model, num_blocks=8, num_swa_slots=8, max_num_seqs=4))
    ref = EngineCore(EngineConfig(model=model, enable_prefix_caching=False))
    try:
        for i in range(4):  # each leaves a retained slot holding its partial (second) block
            b.add(CoreRequest(f"r{i}", tuple(prompt_of(i, 300)), PARAMS))
            finish(b, f"r{i}")
        cache = b.scheduler.cache
        assert cache.slots.num_retained_partials == 4
        free_without_retained = cache.blocks.num_available
        assert free_without_retained == 4
        prompt = prompt_of(99, 1300)  # 5 full blocks + a tail at export: 6 blocks > 4
        a.add(CoreRequest("h", tuple(prompt), PARAMS))
        got: list[int] = []
        while not got:
            got += [t for o in a.step() if o.request_id == "h" for t in o.new_token_ids]
        payload = a.export_sequence("h")
        got += [t for o in a.take_outputs() if o.request_id == "h" for t in o.new_token_ids]
        b.import_sequence(payload)
        assert cache.slots.num_retained_partials < 4  # it took retained blocks back
        ref.add(CoreRequest("h", tuple(prompt), PARAMS))
        assert finish(b, "h", got) == finish(ref, "h")
        cache.blocks.check_invariants()
    finally:
        for core in (a, b, ref):
            core.close()
