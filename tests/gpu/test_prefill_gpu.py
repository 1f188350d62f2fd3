"""Prefill on the GPU (engine/model/prefill.py, engine/kernels/prefill_attention.py).

* The prefill attention kernel against the torch path it replaces, at flash-shape widths
  (64 heads x 512, window 128, CSA top-512 of 1,000 entries, HCA), in bf16: close; and a
  query's row is the same bitwise whichever chunk of the step computes it.
* The CSA indexer's chunked selection with a running top-k on a 16,384-token prompt at
  flash-shape indexer widths (64 heads x 128) against one sort over each whole row.
* With the batch-invariant mode on: chunked prefill gives the logits of unchunked prefill bit
  for bit, and a prefix hit gives the tokens and logprobs of a recompute.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import triton_available
from engine.model import prefill
from engine.model.compressor import Indexer, topk_lowest_index

pytestmark = pytest.mark.skipif(not triton_available(), reason="the prefill kernel needs Triton")

H, HD, W = 64, 512, 128


def _inputs(n0: int, n: int, rate: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = dict(device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(n, H, HD, **bf)
    ring = torch.randn(W - 1, HD, **bf)
    new = torch.randn(n, HD, **bf)
    entries = torch.randn((n0 + n) // rate, HD, **bf)
    sinks = torch.randn(H, device="cuda", generator=g)
    return q, prefill.window_rows(ring, new, W), entries, sinks


def _torch_path(monkeypatch, *args, **kwargs) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setattr(prefill.kernel, "usable", lambda q: False)
        return prefill.attend_sequence(*args, **kwargs)


@pytest.mark.parametrize("hidden", [0, 77])  # ring rows below the replay's window_from
@pytest.mark.parametrize("layer", ["sliding", "hca", "csa"])
def test_the_kernel_matches_the_torch_path_at_flash_widths(layer: str, hidden: int, monkeypatch) -> None:
    n0, n = 3000, 1024
    rate = {"sliding": 1, "hca": 128, "csa": 4}[layer]
    q, raw, entries, sinks = _inputs(n0, n, rate)
    lo = n0 - W + 1 + hidden
    compressed = None if layer == "sliding" else (entries, rate)
    csa = None
    if layer == "csa":
        g = torch.Generator(device="cuda").manual_seed(1)
        ix = Indexer(4096, 1024, 128, 64, 4, 512, 1e-6).cuda()
        csa = (
            ix, torch.randn(n, 64, 128, device="cuda", generator=g, dtype=torch.bfloat16),
            torch.rand(n, 64, device="cuda", generator=g),
            torch.randn(entries.shape[0], 128, device="cuda", generator=g, dtype=torch.bfloat16),
        )  # fmt: skip
    assert prefill.kernel.usable(q)
    got = prefill.attend_sequence(q, raw, n0, lo, W, sinks, compressed, csa)
    want = _torch_path(monkeypatch, q, raw, n0, lo, W, sinks, compressed, csa)
    err = (got.float() - want.float()).abs().max().item()
    print(f"{layer}: max |kernel - torch| {err:.3g}")
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_a_query_row_does_not_depend_on_the_chunk_that_computes_it() -> None:
    from engine.kernels import prefill_attention as k

    n0, n, rate = 3000, 1024, 4
    q, raw, entries, sinks = _inputs(n0, n, rate, seed=2)
    g = torch.Generator(device="cuda").manual_seed(3)
    idx = torch.randint(0, entries.shape[0], (n, 512), device="cuda", generator=g)
    idx[::7, 300:] = -1
    lead = 0
    whole = k.prefill_attention(q, raw, n0, lead, W, sinks, entries, rate, idx)
    for s, c in ((0, 1), (100, 200), (700, 324)):
        part = k.prefill_attention(
            q[s : s + c], raw[s : s + c + W - 1], n0 + s, lead, W, sinks, entries, rate, idx[s : s + c]
        )
        assert torch.equal(part, whole[s : s + c]), (s, c)


def test_the_indexer_selects_what_one_sort_per_row_selects_on_a_16k_prompt() -> None:
    n, rate = 16384, 4
    e = n // rate
    ix = Indexer(4096, 1024, 128, 64, rate, 512, 1e-6).cuda()
    g = torch.Generator(device="cuda").manual_seed(4)
    iq = torch.randn(n, 64, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    iw = torch.rand(n, 64, device="cuda", generator=g)
    ikeys = torch.randn(e, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    got = prefill._choices((ix, iq, iw, ikeys), 0, n, rate, e)  # [n, 512], -1: none
    differ = total = 0
    for s in range(0, n, 512):  # the reference: every entry of each row scored at once
        count = torch.arange(s + 1, s + 513, device="cuda") // rate
        scores = F.relu(torch.einsum("chd,ed->che", iq[s : s + 512].float(), ikeys.float())) * 128**-0.5
        scores = (scores * iw[s : s + 512].unsqueeze(-1)).sum(dim=1)
        scores = scores.masked_fill(torch.arange(e, device="cuda")[None, :] >= count[:, None], float("-inf"))
        top = topk_lowest_index(scores, 512)
        want = torch.where(top < count[:, None], top, -1).sort(dim=1).values
        mine = got[s : s + 512].sort(dim=1).values
        total += int((want >= 0).sum())
        for r in (mine != want).any(dim=1).nonzero().flatten().tolist():
            # a different pick must be a near-tie of the k-th score the whole-row sort kept
            a, b = set(mine[r].tolist()) - {-1}, set(want[r].tolist()) - {-1}
            assert len(a) == len(b), r + s
            kth = scores[r][want[r][want[r] >= 0]].min()
            picked = scores[r][torch.tensor(sorted(a - b), device="cuda")]
            assert bool(((picked - kth).abs() <= 1e-5 * kth.abs().clamp(min=1)).all()), r + s
            differ += len(a - b)
    print(f"indexer at 16K: {differ} of {total} selections differ (near-ties)")


def _trained_llm(**kw):
    from engine.checkpoint.presets import SHIPPED
    from engine.llm import LLM

    common = dict(
        device="cuda", dtype="bfloat16", batch_invariant=True, max_num_seqs=8, num_swa_slots=8,
        num_blocks=64,
    )  # fmt: skip
    return LLM(SHIPPED["trained"], **(common | kw))


def test_invariant_mode_chunked_prefill_and_a_prefix_hit_equal_one_chunk_and_a_recompute() -> None:
    from engine.kernels import batch_invariant as bi
    from engine.sampling.params import SamplingParams

    ids = torch.randint(200, 3000, (1500,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)

    def answer(llm) -> tuple[list[int], list[float]]:
        out = llm.generate(prompt_token_ids=[ids], sampling_params=params)[0].outputs[0]
        return out.token_ids, [lp.logprob for lp in out.logprobs]

    try:
        whole = _trained_llm(max_num_batched_tokens=2048, enable_prefix_caching=False)
        one = answer(whole)
        del whole
        chunked = _trained_llm(max_num_batched_tokens=256, enable_prefix_caching=True)
        several = answer(chunked)
        hit = answer(chunked)  # the second time: a prefix hit on the first's blocks
        assert several == one, "chunked prefill differs from one chunk"
        assert hit == one, "a prefix hit differs from the recompute"
    finally:
        bi.disable()
