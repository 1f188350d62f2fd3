"""``LLM.generate`` end to end on tiny random DeepSeek-V4 checkpoints (fp32, CPU).

The reference is transformers' greedy decoding: the next token is the argmax of the
reference model's forward over the whole sequence (``use_cache=False``). It is checked by
teacher forcing: one reference forward over prompt + engine output must put its argmax on
the engine's token at every generated position, which by induction is token-for-token
equality with transformers' greedy sequence (64 forwards become one). Note: in transformers
5.24 ``DeepseekV4ForCausalLM.generate()`` disagrees with its own forward once the prompt is
longer than 128 tokens (docs/engine-runtime.md), so the forward is the ground truth here.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_hf_greedy(model, prompt: list[int], out: list[int]) -> None:
    """``out`` is transformers' greedy continuation of ``prompt`` (teacher forcing)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out[:-1]]), use_cache=False).logits[0]  # [S, V]
    want = logits[len(prompt) - 1 :].argmax(-1).tolist()
    first_diff = next((i for i, (a, b) in enumerate(zip(out, want)) if a != b), None)
    assert first_diff is None, (
        f"token {first_diff}: engine {out[first_diff]}, transformers {want[first_diff]}"
    )


def make(path, **kw) -> LLM:
    base = dict(num_blocks=24, num_swa_slots=16, max_num_seqs=8, max_num_batched_tokens=48)
    return LLM(path, **{**base, **kw})


@pytest.fixture(scope="module")
def mixed(reference):
    return reference("mixed_hc2")


def test_greedy_equals_transformers_mixed_lengths_several_chunks(mixed):
    path, ref = mixed
    prompts = [ids(5, 1), ids(70, 2), ids(130, 3)]
    llm = make(path)  # 48-token budget: the prompts take 1, 2 and 3 chunks, mixed with decodes
    try:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    finally:
        llm.close()
    for p, o in zip(prompts, outs):
        assert len(o.outputs[0].token_ids) == 64
        assert_hf_greedy(ref, p, o.outputs[0].token_ids)
        assert o.outputs[0].finish_reason == "length" and o.num_cached_tokens == 0


def test_greedy_with_prefix_cache_hit_equals_transformers(mixed):
    path, ref = mixed
    llm = make(path)
    try:
        first = ids(40, 4)
        out1 = llm.generate(prompt_token_ids=[first], sampling_params=GREEDY)[0].outputs[0].token_ids
        turn2 = first + out1 + ids(20, 5)  # a second chat turn extends the whole first one
        out2 = llm.generate(prompt_token_ids=[turn2], sampling_params=GREEDY)[0]
    finally:
        llm.close()
    assert out2.num_cached_tokens == len(first) + len(out1) - 1  # the retained slot's exact state
    assert_hf_greedy(ref, first, out1)
    assert_hf_greedy(ref, turn2, out2.outputs[0].token_ids)
    assert llm.scheduler.cache.slots.reused == 1


def _seeded(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1000 + i, max_tokens=6, ignore_eos=True)


def test_batch_invariance_alone_together_and_other_chunk_budget(mixed):
    path, _ = mixed
    prompts = [ids(3 + 2 * i, 100 + i) for i in range(16)]
    params = [_seeded(i) for i in range(16)]
    llm = make(path, num_blocks=40, max_num_seqs=16, num_swa_slots=24)
    try:
        together = [
            o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)
        ]
        alone = [
            llm.generate(prompt_token_ids=[p], sampling_params=sp)[0].outputs[0].token_ids
            for p, sp in zip(prompts, params)
        ]
    finally:
        llm.close()
    other = make(
        path,
        num_blocks=40,
        max_num_seqs=16,
        num_swa_slots=24,
        max_num_batched_tokens=17,
        async_scheduling=False,
    )
    try:
        small = [
            o.outputs[0].token_ids for o in other.generate(prompt_token_ids=prompts, sampling_params=params)
        ]
    finally:
        other.close()
    assert together == alone == small
    assert len({tuple(t) for t in together}) > 8  # sampled, not degenerate


def test_batch_invariant_mode_keeps_tokens_and_never_mixes_a_step(mixed):
    """``batch_invariant=True`` on CPU: the kernels are torch's (there is nothing to switch),
    the scheduling is the mode's: no step holds both decodes and prefill chunks, and the
    tokens are the same alone and together (the GPU test: tests/gpu/test_batch_invariance_gpu.py)."""
    path, _ = mixed
    prompts = [ids(300 + 7 * i, 5 + 3 * i) for i in range(6)]  # 300+ tokens: two chunks of 256
    params = [_seeded(i) for i in range(6)]
    llm = make(
        path,
        num_blocks=40,
        max_num_seqs=8,
        num_swa_slots=8,
        max_num_batched_tokens=1024,
        batch_invariant=True,
    )
    try:
        together = [
            o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)
        ]
        stats = list(llm.loop.stats)
        alone = [
            llm.generate(prompt_token_ids=[p], sampling_params=sp)[0].outputs[0].token_ids
            for p, sp in zip(prompts, params)
        ]
    finally:
        llm.close()
    assert together == alone
    assert not [s for s in stats if s.prefill_tokens and s.decode_tokens]
    assert max(s.prefill_tokens for s in stats) > 256  # several prompts' chunks share a step


def test_preemption_loses_nothing_and_changes_no_greedy_output(mixed):
    path, _ = mixed
    prompts = [ids(250 + i, 200 + i) for i in range(4)]  # each crosses into a second block
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    roomy = make(path, num_blocks=16, max_num_batched_tokens=512)
    tight = make(path, num_blocks=5, max_num_batched_tokens=512)
    try:
        want = [o.outputs[0].token_ids for o in roomy.generate(prompt_token_ids=prompts, sampling_params=sp)]
        got = [o.outputs[0].token_ids for o in tight.generate(prompt_token_ids=prompts, sampling_params=sp)]
    finally:
        roomy.close()
        tight.close()
    assert tight.scheduler.num_preemptions > 0
    assert got == want


def test_async_and_sync_give_identical_results(mixed):
    path, _ = mixed
    prompts = [ids(9 + i, 300 + i) for i in range(4)]
    params = [_seeded(i) for i in range(4)]
    res = []
    for async_scheduling in (True, False):
        llm = make(path, async_scheduling=async_scheduling)
        try:
            res.append(
                [
                    o.outputs[0].token_ids
                    for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)
                ]
            )
        finally:
            llm.close()
    assert res[0] == res[1]


def test_n_seeds_logprobs_priority_and_bad_requests(mixed):
    path, _ = mixed
    llm = make(path)
    try:
        sp = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True, logprobs=3)
        a = llm.generate(prompt_token_ids=[ids(12, 9)], sampling_params=sp)[0]
        b = llm.generate(prompt_token_ids=[ids(12, 9)], sampling_params=sp)[0]
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]  # reproducible
        assert len({tuple(c.token_ids) for c in a.outputs}) > 1  # n distinct samples
        # Forked children equal independent requests with the children's derived seeds.
        from engine.sampling.params import derive_seed

        alone = [
            llm.generate(
                prompt_token_ids=[ids(12, 9)],
                sampling_params=SamplingParams(
                    temperature=1.0, seed=derive_seed(5, f"child:{i}"), max_tokens=6, ignore_eos=True
                ),
            )[0]
            .outputs[0]
            .token_ids
            for i in range(3)
        ]
        assert alone == [c.token_ids for c in a.outputs]
        lp = a.outputs[0].logprobs
        assert lp is not None and len(lp) == 6 and all(x is not None and len(x.top) == 3 for x in lp)
        with pytest.raises(ValueError, match="outside"):
            llm.generate(prompt_token_ids=[[1, 2, 999]], sampling_params=GREEDY)
        with pytest.raises(ValueError, match="empty"):
            llm.generate(prompt_token_ids=[[]], sampling_params=GREEDY)
        with pytest.raises(ValueError, match="exceeds the cache"):  # the 2nd is too long: none admitted
            llm.generate(prompt_token_ids=[[1, 2], [3] * (24 * 256)], sampling_params=GREEDY)
        assert not llm.scheduler.has_unfinished()
        # still serving after the rejections
        assert (
            len(llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=GREEDY)[0].outputs[0].token_ids)
            == 64
        )
    finally:
        llm.close()


def test_saved_cost_model_drives_chunking_without_changing_outputs(mixed, tmp_path):
    from costmodel import CostModel

    path, ref = mixed
    model = CostModel(a=2e-6, b=1e-4, c=1e-3)
    saved = tmp_path / "cost.json"
    saved.write_text(model.to_json())
    prompt = ids(120, 7)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = make(path, cost_model_path=str(saved), step_time_budget_s=0.01, max_num_batched_tokens=4096)
    try:
        assert llm.scheduler.config.cost_model == model
        steps_before = llm.loop.steps
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=sp)[0].outputs[0].token_ids
        # 120 tokens at <= 10 ms predicted per step: several chunks, not one 120-token step
        assert llm.loop.steps - steps_before >= 3 + 3
    finally:
        llm.close()
    assert_hf_greedy(ref, prompt, out)


def test_shared_prefix_hit_without_slot_is_replayed_exactly(mixed):
    """Two requests share a 300-token prefix; the first's slot has moved on, so the second
    reuses the cached block and replays L * (W - 1) = 4 * 15 tokens to rebuild its window."""
    path, ref = mixed
    prefix = ids(300, 8)
    a, b = prefix + ids(10, 9), prefix + ids(12, 10)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = make(path, max_num_batched_tokens=512)
    try:
        llm.generate(prompt_token_ids=[a], sampling_params=sp)
        out = llm.generate(prompt_token_ids=[b], sampling_params=sp)[0]
    finally:
        llm.close()
    assert out.num_cached_tokens == 256 - 4 * 15
    assert_hf_greedy(ref, b, out.outputs[0].token_ids)
