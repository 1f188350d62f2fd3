"""Batch-invariant mode on the GPU (engine/kernels/batch_invariant.py): a request's logits and
tokens are the same alone and in batches of 7, 64 and 200, and whether its step carries one
query token or several (speculative verification).

Each kernel is checked against torch (close) and against itself on a longer batch (bitwise);
torch's own kernels are measured the same way and their variation printed, not asserted
(it depends on the GPU and the library version). The mode is process-wide: every test
switches it off again."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from engine.checkpoint.presets import SHIPPED, preset_config
from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch, SequenceInput
from engine.kernels import batch_invariant as bi
from engine.kernels import grouped, triton_available
from engine.model.decode import decode_attend
from engine.runner import ModelRunner, RunnerConfig

pytestmark = pytest.mark.skipif(not triton_available(), reason="the batch-invariant kernels need Triton")

BATCHES = (1, 7, 64, 200)


@contextlib.contextmanager
def invariant():
    bi.enable()
    try:
        yield
    finally:
        bi.disable()


def _varies(fn, x: torch.Tensor) -> list[int]:
    """Batch sizes at which the first rows of ``fn(x[:m])`` differ from those of ``fn(x)``."""
    full = fn(x)
    return [m for m in BATCHES if not torch.equal(fn(x[:m]), full[:m])]


#: (in, out, dtype): V4-Flash's projections, the mHC mixing (fp32) and a narrow one
LINEARS = [
    (4096, 1024, torch.bfloat16), (1024, 32768, torch.bfloat16), (4096, 512, torch.bfloat16),
    (1024, 8192, torch.bfloat16), (16384, 24, torch.float32), (4096, 129280, torch.bfloat16),
    (256, 64, torch.bfloat16),
]  # fmt: skip


@pytest.mark.parametrize(("k", "n", "dtype"), LINEARS)
def test_linear_rows_do_not_depend_on_the_batch(k: int, n: int, dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(k + n)
    x = torch.randn(200, k, device="cuda", dtype=dtype, generator=gen)
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) * k**-0.5
    bias = torch.randn(n, device="cuda", dtype=dtype, generator=gen)
    stock = _varies(lambda t: F.linear(t, w), x)
    want = F.linear(x.double(), w.double())
    with invariant():
        assert _varies(lambda t: F.linear(t, w), x) == []
        assert _varies(lambda t: F.linear(t, w, bias), x) == []
        got = F.linear(x, w)
        with_bias = F.linear(x, w, bias)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (got.double() - want).abs().max().item() <= tol * want.abs().max().item()
    assert (
        with_bias.double() - want - bias.double()
    ).abs().max().item() <= tol * want.abs().max().item() + 0.05
    print(f"linear {k}->{n} {dtype}: torch's rows vary at batch {stock or 'none'}; invariant mode: none")


def test_attention_einsums_and_hc_matmul_do_not_depend_on_the_batch() -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(200, 64, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
    keys = torch.randn(200, 640, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
    comb = torch.rand(200, 4, 4, device="cuda", dtype=torch.bfloat16, generator=gen)
    streams = torch.randn(200, 4, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)

    def scores(t):
        return torch.einsum("bhd,bkd->bhk", t, keys[: t.shape[0]])

    def mix(t):
        return torch.matmul(t.transpose(-1, -2), streams[: t.shape[0]])

    stock = (_varies(scores, q), _varies(mix, comb))
    with invariant():
        assert _varies(scores, q) == [] and _varies(mix, comb) == []
        got = scores(q[:3])
    want = torch.einsum("bhd,bkd->bhk", q[:3].double(), keys[:3].double())
    assert (got.double() - want).abs().max().item() <= 1e-2 * want.abs().max().item()
    print(f"einsum/bmm: torch's rows vary at batch {stock}; invariant mode: none")


def test_grouped_experts_match_a_loop_and_ignore_other_rows() -> None:
    gen = torch.Generator(device="cuda").manual_seed(2)
    e, d, n = 16, 1024, 512
    w = torch.randn(e, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) * d**-0.5
    x = torch.randn(300, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    ids = torch.randint(0, e, (300,), device="cuda", generator=gen)

    def run(rows: int) -> torch.Tensor:
        sub = ids[:rows]
        order = torch.argsort(sub, stable=True)
        ends = torch.cumsum(torch.bincount(sub, minlength=e), 0).to(torch.int32)
        out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
        out[order] = grouped.grouped_matmul(x[:rows][order], w, ends)
        return out

    full = run(300)
    for rows in (1, 7, 64, 200):
        assert torch.equal(run(rows), full[:rows]), rows
    want = torch.stack([x[i].double() @ w[ids[i]].double().T for i in range(300)])
    assert (full.double() - want).abs().max().item() <= 1e-2 * want.abs().max().item()
    empty = grouped.grouped_matmul(x[:0], w, torch.zeros(e, dtype=torch.int32, device="cuda"))
    assert empty.shape == (0, n)


def test_attention_kernel_matches_eager_and_ignores_padding_and_batch_mates() -> None:
    gen = torch.Generator(device="cuda").manual_seed(3)
    b, h, d, k = 64, 64, 512, 640
    q = torch.randn(b, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    keys = torch.randn(b, k + 96, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    visible = torch.rand(b, k + 96, device="cuda", generator=gen) < 0.7
    visible[:, k:] = False  # padding a longer batch-mate or a graph bucket adds
    visible[5] = False  # a row that sees nothing: the sink takes all of it
    sinks = torch.randn(h, device="cuda", generator=gen)
    want = decode_attend(q.float(), keys.float(), visible, sinks)  # eager fp32
    got = bi.attend(q, keys, visible, sinks)
    assert (got.float() - want).abs().max().item() < 2e-2
    assert got[5].abs().max().item() == 0
    alone = bi.attend(q[:1], keys[:1, :k], visible[:1, :k], sinks)
    assert torch.equal(alone, got[:1])
    assert torch.equal(bi.attend(q[:7], keys[:7, : k + 32], visible[:7, : k + 32], sinks), got[:7])


# -- end to end --------------------------------------------------------------------------------

PROMPT, STEPS = 150, 24


def _small(batch_invariant: bool, graphs: str, slots: int) -> ModelRunner:
    mcfg = ModelConfig.from_dict(preset_config("small"))
    blocks = slots * 2
    cfg = RunnerConfig(
        num_blocks=blocks, num_slots=slots, dtype="bfloat16", device="cuda", with_mtp=False,
        decode_graphs=graphs, batch_invariant=batch_invariant,
    )  # fmt: skip
    return ModelRunner.random(mcfg, cfg, seed=0)


def _target(vocab: int) -> list[int]:
    return torch.randint(3, vocab, (PROMPT + STEPS,), generator=torch.Generator().manual_seed(7)).tolist()


def _run(runner: ModelRunner, mates: int, per_step: int = 1) -> list[torch.Tensor]:
    """Row 0 (the target, teacher-forced) prefilled beside ``mates`` other prompts, then
    decoded with them: the target's logits at every position after its prompt. ``per_step``
    > 1: the target's steps carry that many tokens (the verification path)."""
    vocab = runner.model_cfg.vocab_size
    gen = torch.Generator().manual_seed(mates)
    lens = [PROMPT] + torch.randint(1, 300, (mates,), generator=gen).tolist()
    seqs = [_target(vocab)] + [
        torch.randint(3, vocab, (n + STEPS,), generator=gen).tolist() for n in lens[1:]
    ]
    tables = [[2 * i, 2 * i + 1] for i in range(len(seqs))]
    first = [SequenceInput(s[:n], 0, i, tables[i]) for i, (s, n) in enumerate(zip(seqs, lens))]
    out = [runner.execute(ForwardBatch.from_sequences(first, device="cuda")).logits[:1].float().cpu()]
    t = 0
    k = per_step
    while t + k <= STEPS:
        step = [SequenceInput(seqs[0][PROMPT + t : PROMPT + t + k], PROMPT + t, 0, tables[0], num_logits=k)]
        step += [
            SequenceInput(s[n + t : n + t + k], n + t, i + 1, tables[i + 1], num_logits=k)
            for i, (s, n) in enumerate(zip(seqs[1:], lens[1:]))
        ]
        logits = runner.execute(ForwardBatch.from_sequences(step, device="cuda")).logits
        out.append(logits[:k].float().cpu())
        t += k
    torch.cuda.synchronize()
    return list(torch.cat(out).unbind(0))


@pytest.mark.parametrize("graphs", ["off", "auto"])
def test_a_sequence_gets_the_same_logits_alone_in_batches_and_with_several_query_tokens(graphs: str) -> None:
    """The small preset's widths, random weights, bf16: the target's logits at every step are
    bitwise equal alone and beside 6, 63 and 199 other sequences of other lengths, and when
    its steps carry 3 tokens at once (the verification path)."""
    try:
        runner = _small(True, graphs, slots=200)
        alone = _run(runner, 0)
        for mates in (6, 63, 199):
            got = _run(runner, mates)
            diff = [i for i, (a, b) in enumerate(zip(alone, got)) if not torch.equal(a, b)]
            assert diff == [], f"beside {mates}: positions {diff} differ"
        several = _run(runner, 6, per_step=3)
        diff = [i for i, (a, b) in enumerate(zip(alone, several)) if not torch.equal(a, b)]
        assert diff == [], f"3 query tokens a step: positions {diff} differ"
        if graphs == "auto":
            assert runner.graphs is not None and runner.graphs.replays > 0
    finally:
        bi.disable()
    stock = _small(False, graphs, slots=200)
    ref = _run(stock, 0)
    varied = {m: sum(not torch.equal(a, b) for a, b in zip(ref, _run(stock, m))) for m in (6, 63, 199)}
    print(f"graphs {graphs}: without the mode, positions differing from alone: {varied} of {len(ref)}")


def test_the_engine_gives_a_request_the_same_tokens_alone_in_batches_and_with_speculation() -> None:
    """The trained preset through `LLM`, bf16 with graphs: one greedy and one seeded-sampling
    request, alone and among 6, 63 and 199 others, then with speculative decoding (steps of
    several query tokens): the same tokens and logprobs every time."""
    from engine.llm import LLM
    from engine.sampling.params import SamplingParams

    common = dict(
        device="cuda", dtype="bfloat16", batch_invariant=True, enable_prefix_caching=False,
        max_num_seqs=256, num_swa_slots=256, num_blocks=1024, max_num_batched_tokens=65536,
    )  # fmt: skip
    targets = [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=0),
        SamplingParams(max_tokens=40, temperature=0.8, seed=11, ignore_eos=True, logprobs=0),
    ]
    prompt = "def parse_header(line):\n    "
    gen = torch.Generator().manual_seed(0)

    def others(n: int) -> list[list[int]]:
        return [
            torch.randint(
                200, 3000, (int(torch.randint(4, 120, (1,), generator=gen)),), generator=gen
            ).tolist()
            for _ in range(n)
        ]

    def answers(llm: LLM, mates: int) -> list[tuple[list[int], list[float]]]:
        ids = llm.tokenizer.encode(prompt).ids
        rest = others(mates)
        params = targets + [
            SamplingParams(max_tokens=int(torch.randint(8, 48, (1,), generator=gen)), temperature=0.0)
            for _ in rest
        ]
        outs = llm.generate(prompt_token_ids=[ids, ids] + rest, sampling_params=params)
        return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs[:2]]

    try:
        llm = LLM(SHIPPED["trained"], **common)
        alone = answers(llm, 0)
        for mates in (5, 62, 198):  # with the two targets: 7, 64 and 200 requests
            assert answers(llm, mates) == alone, mates
        del llm
        spec = LLM(SHIPPED["trained"], speculative="fixed-3", **common)
        assert answers(spec, 0) == alone
        assert answers(spec, 62) == alone
    finally:
        bi.disable()


def test_graphed_speculation_equals_its_padded_batches_run_eagerly() -> None:
    """The trained preset with fixed-3 and DSpark speculation, bf16, the mode off: verification
    steps and drafting chains as CUDA graphs give the tokens, drafts and acceptance of the same
    padded batches run eagerly (graphs capture, they do not change the arithmetic)."""
    from engine.llm import LLM
    from engine.sampling.params import SamplingParams

    gen = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(200, 3000, (int(torch.randint(4, 200, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(24)
    ]
    params = [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True) for _ in prompts]
    keys = ("spec_drafted_tokens", "spec_verified_tokens", "spec_accepted_tokens")
    for policy in ("fixed-3", "dspark"):
        got = {}
        for mode in ("auto", "padded"):
            llm = LLM(
                SHIPPED["trained"], device="cuda", dtype="bfloat16", speculative=policy,
                decode_graphs=mode, max_num_seqs=32, num_swa_slots=64,
            )  # fmt: skip
            try:
                outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
                extra = llm.core.stats().extra
            finally:
                llm.close()
            got[mode] = ([o.outputs[0].token_ids for o in outs], [extra[k] for k in keys])
            print(
                policy,
                mode,
                {
                    k: extra.get(k)
                    for k in (
                        *keys,
                        "graph_replays",
                        "graph_verify_steps",
                        "graph_draft_chains",
                        "graph_captures",
                    )
                },
            )
            if mode == "auto":
                assert extra["graph_draft_chains"] > 0
                assert policy != "fixed-3" or extra["graph_verify_steps"] > 0
        assert got["auto"] == got["padded"], policy


def test_the_mode_keeps_the_reference_accuracy_in_bf16(tmp_path) -> None:
    """The mode's kernels, graphs on, against transformers' fp32 reference (the CUDA-graph
    test's sequences): their largest logit error is the stock bf16 path's, within a factor of
    two plus 1e-3, and greedy agreement is reported beside it."""
    from tests.gpu.test_decode_graphs import PROMPTS, STEPS, _decode, _seqs
    from tests.unit.engine.refmodel import build_reference

    ref = build_reference(tmp_path, "mixed_hc2")
    seqs = _seqs(ref.config.vocab_size)
    n = len(PROMPTS)

    def runner(invariant: bool) -> ModelRunner:
        cfg = RunnerConfig(
            num_blocks=n, num_slots=n, dtype="bfloat16", device="cuda", batch_invariant=invariant
        )
        return ModelRunner(tmp_path, cfg)

    try:
        got = _decode(runner(True), seqs)
    finally:
        bi.disable()
    stock = _decode(runner(False), seqs)
    with torch.no_grad():
        want = [ref(torch.tensor(s)[None], use_cache=False).logits[0].float() for s in seqs]
    err, agree = {"invariant": 0.0, "stock": 0.0}, {"invariant": 0, "stock": 0}
    for t in range(STEPS):
        for i, p in enumerate(PROMPTS):
            for name, out in (("invariant", got), ("stock", stock)):
                err[name] = max(err[name], (out[t][i] - want[i][p + t]).abs().max().item())
                agree[name] += int(out[t][i].argmax() == want[i][p + t].argmax())
    print(
        f"bf16 vs fp32 reference: max |logit error| invariant {err['invariant']:.4f}, stock {err['stock']:.4f}; "
        f"greedy agreement invariant {agree['invariant'] / (STEPS * n):.3f}, stock {agree['stock'] / (STEPS * n):.3f}"
    )
    assert err["invariant"] <= 2 * err["stock"] + 1e-3
