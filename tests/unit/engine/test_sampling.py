from __future__ import annotations

import math

import pytest
import torch

from engine.sampling.params import SamplingParams
from engine.sampling.sampler import RowInput, draw_seed, sample, sample_row, sample_rows
from engine.sampling.stop import StopStringMatcher

V = 1000


def row(params: SamplingParams, seed: int = 7, idx: int = 0, prompt=(1, 2), out=()) -> RowInput:
    return RowInput(params, seed, idx, list(prompt), list(out))


def test_greedy_is_argmax_with_lowest_id_on_ties():
    logits = torch.zeros(V)
    logits[[5, 9, 700]] = 3.0
    assert sample_row(logits, row(SamplingParams(temperature=0.0))).token_id == 5


def test_seeded_rows_are_batch_invariant_and_depend_on_seed_and_position():
    torch.manual_seed(0)
    logits = torch.randn(16, V) * 3
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.01)
    rows = [row(params, seed=100 + i) for i in range(16)]
    together = [r.token_id for r in sample(logits, rows)]
    alone = [sample_row(logits[i].clone(), rows[i]).token_id for i in range(16)]
    perm = list(reversed(range(16)))
    shuffled = sample(logits[perm], [rows[i] for i in perm])
    assert together == alone == [shuffled[perm.index(i)].token_id for i in range(16)]
    # A different seed or position changes the draws for most rows.
    other = [sample_row(logits[i], row(params, seed=999 + i)).token_id for i in range(16)]
    later = [sample_row(logits[i], row(params, seed=100 + i, idx=1)).token_id for i in range(16)]
    assert other != together and later != together


def test_empirical_distribution_matches_softmax():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    p = SamplingParams(temperature=1.0)
    counts = [0, 0, 0]
    for i in range(3000):
        counts[sample_row(logits, row(p, seed=i)).token_id] += 1
    for c, q in zip(counts, (0.5, 0.3, 0.2)):
        assert abs(c / 3000 - q) < 0.03


def test_truncation_only_samples_allowed_tokens():
    logits = torch.arange(V, dtype=torch.float32) / 100  # token 999 most likely
    k = {sample_row(logits, row(SamplingParams(top_k=3), seed=s)).token_id for s in range(200)}
    assert k <= {997, 998, 999} and len(k) == 3
    sharp = torch.tensor([5.0, 4.0, -5.0, -6.0])
    top_p = {sample_row(sharp, row(SamplingParams(top_p=0.5), seed=s)).token_id for s in range(100)}
    assert top_p == {0}  # token 0 alone has p = 0.73 >= 0.5
    min_p = {sample_row(sharp, row(SamplingParams(min_p=0.2), seed=s)).token_id for s in range(200)}
    assert min_p == {0, 1}


def test_penalties_follow_vllm_definitions():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    # token 0 seen in the prompt: 2.0 / 2 = 1.0 ties with token 2 -> lowest id still wins
    assert sample_row(logits, row(p, prompt=(0,))).token_id == 0
    p = SamplingParams(temperature=0.0, repetition_penalty=4.0)
    assert sample_row(logits, row(p, prompt=(0,))).token_id == 2
    p = SamplingParams(temperature=0.0, frequency_penalty=0.3, presence_penalty=0.5)
    # output has token 0 twice: 2.0 - 0.6 - 0.5 = 0.9 < 1.0
    assert sample_row(logits, row(p, prompt=(), out=(0, 0))).token_id == 2
    assert sample_row(logits, row(p, prompt=(0, 0), out=())).token_id == 0  # prompt not counted


def test_logprobs_are_raw_model_logprobs_with_ranks():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0])
    res = sample_row(
        logits, row(SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=9.0), prompt=(1,))
    )
    lp = torch.log_softmax(logits, 0)
    assert res.token_id == 2  # penalised away from 1 ...
    assert res.logprobs is not None
    assert math.isclose(res.logprobs.logprob, float(lp[2]), rel_tol=1e-6)  # ... but raw logprob
    assert res.logprobs.rank == 2
    assert [t for t, _ in res.logprobs.top] == [1, 2]


def test_grammar_mask_restricts_choices():
    logits = torch.zeros(8)
    mask = torch.zeros(8, dtype=torch.bool)
    mask[[3, 6]] = True
    got = {
        sample_row(logits, RowInput(SamplingParams(), s, 0, [], [], allowed_mask=mask)).token_id
        for s in range(50)
    }
    assert got == {3, 6}
    with pytest.raises(ValueError, match="allows no token"):
        sample_row(
            logits, RowInput(SamplingParams(), 0, 0, [], [], allowed_mask=torch.zeros(8, dtype=torch.bool))
        )


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"n": 0}, "n must"),
        ({"n": 1000}, "n must"),
        ({"logprobs": 21}, "logprobs"),
        ({"top_p": 0.0}, "top_p"),
        ({"temperature": -1}, "temperature"),
        ({"stop": ("",)}, "stop"),
        ({"n": 2, "temperature": 0.0}, "identical"),
    ],
)
def test_invalid_params_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_stop_strings_hold_back_partial_matches():
    m = StopStringMatcher(("STOP", "\n\n"))
    text = ""
    emitted = []
    for piece in ["Hello", " ST", "O", "P and more"]:
        text += piece
        safe, match = m.feed(text)
        emitted.append(safe)
        if match:
            break
    assert all("S" not in e for e in emitted[:-1])  # "ST" / "STO" were never shown
    assert match is not None and match.text == "Hello " and match.stop == "STOP"
    inc = StopStringMatcher(("lo",), include_stop=True)
    assert inc.feed("hello world")[1].text == "hello"
    assert StopStringMatcher(()).feed("abc\ufffd")[0] == "abc"


def test_a_batch_argmax_equals_each_rows_greedy_sample_ties_included():
    """The executor takes plain greedy tokens from one argmax over the step's rows: it must be
    what ``sample_row`` gives row by row (lowest id on ties), with the same logprobs."""
    from engine.sampling.sampler import plain_greedy, token_logprobs

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 50, generator=g)
    logits[2, 7] = logits[2, 31] = logits[2].max() + 1.0  # a tie: 7 wins
    logits[5] = 0.0  # all equal: 0 wins
    params = SamplingParams(temperature=0.0, logprobs=3)
    assert plain_greedy(params) and not plain_greedy(SamplingParams(temperature=0.0, repetition_penalty=1.2))
    assert not plain_greedy(SamplingParams(temperature=0.7))
    top = logits.argmax(-1).tolist()
    for i in range(9):
        want = sample_row(logits[i], RowInput(params, 0, 0, [1], []))
        assert top[i] == want.token_id
        assert token_logprobs(logits[i], top[i], 3) == want.logprobs
    assert top[2] == 7 and top[5] == 0


def _mixed_params(n: int) -> list[SamplingParams]:
    """Every combination of the truncations, on and off, at several temperatures."""
    out = []
    for i in range(n):
        out.append(
            SamplingParams(
                temperature=(0.3, 0.8, 1.0, 1.7)[i % 4],
                top_k=(0, 1, 20, V)[(i // 4) % 4],
                top_p=(1.0, 0.9, 0.5)[(i // 16) % 3],
                min_p=(0.0, 0.05)[(i // 48) % 2],
            )
        )
    return out


def test_rows_drawn_together_equal_each_row_drawn_alone_in_any_batch() -> None:
    """`sample_rows` (the executor's one pass over a step's sampled rows) gives each row the
    token `sample_row` gives it alone, with other rows of any settings around it."""
    from engine.sampling.sampler import draw_seed, sample_rows

    torch.manual_seed(1)
    logits = torch.randn(96, V) * 4
    params = _mixed_params(96)
    seeds = [draw_seed(500 + i, 3) for i in range(96)]
    together = sample_rows(logits, params, seeds)
    alone = [sample_row(logits[i], row(params[i], seed=500 + i, idx=3)).token_id for i in range(96)]
    assert together == alone
    for size in (1, 7, 64):
        picked = list(range(5, 5 + size))
        assert sample_rows(logits[picked], [params[i] for i in picked], [seeds[i] for i in picked]) == [
            together[i] for i in picked
        ]
    # top_k = 1 is greedy whatever the seed
    ones = [i for i, p in enumerate(params) if p.top_k == 1]
    assert all(together[i] == int(torch.argmax(logits[i])) for i in ones)


def test_the_draw_never_picks_a_token_outside_the_truncation_even_at_the_top_of_the_range() -> None:
    """A uniform number within rounding of 1 lands past the cumulative total: the draw then
    takes the last token with probability, never a removed one."""
    from engine.sampling.sampler import _draw_rows, uniform

    top_seed = (1 << 63) - 1
    assert uniform(top_seed) < 1.0 and uniform(0) == 0.0
    logits = torch.full((3, V), float("-inf"))
    logits[:, 10:20] = torch.randn(3, 10)
    tokens = _draw_rows(logits, [top_seed, 0, top_seed])
    assert tokens[0] == tokens[2] == 19 and tokens[1] == 10


def test_drawn_tokens_follow_the_distribution() -> None:
    """Over 4,000 seeds the draw's frequencies match the softmax (each within 4 standard
    errors), after temperature and top-k."""
    from engine.sampling.sampler import draw_seed, sample_rows

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0] + [-9.0] * 10)
    params = SamplingParams(temperature=0.7, top_k=5)
    n = 4000
    tokens = sample_rows(logits.expand(n, -1), [params] * n, [draw_seed(s, 0) for s in range(n)])
    p = torch.softmax(logits[:5] / 0.7, dim=0)
    counts = torch.bincount(torch.tensor(tokens), minlength=16).float()
    assert counts[5:].sum() == 0
    for t in range(5):
        se = math.sqrt(n * p[t] * (1 - p[t]))
        assert abs(counts[t] - n * p[t]) < 4 * se, (t, counts[t].item(), n * p[t].item())


def _penalised_by_hand(logits: torch.Tensor, r: RowInput) -> torch.Tensor:
    """The penalties written out token by token: repetition over prompt + output (divide a
    positive logit, multiply a negative one), presence and frequency over the output."""
    x = logits.clone()
    p = r.params
    for t in set(r.prompt_token_ids) | set(r.output_token_ids):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(r.output_token_ids):
        x[t] -= p.frequency_penalty * r.output_token_ids.count(t) + p.presence_penalty
    return x


def test_masked_rows_together_equal_each_row_alone() -> None:
    """`draw_masked` (the executor's one pass over a step's grammar / penalised rows) gives each
    row the token `sample_row` gives it alone, and that token is the one of the mask and the
    penalties applied by hand; rows without one of them are left untouched by it."""
    from engine.sampling.sampler import draw_masked

    torch.manual_seed(3)
    logits = torch.randn(48, V) * 3
    rows = []
    for i in range(48):
        params = SamplingParams(
            temperature=(0.0, 0.9)[i % 2], top_k=(0, 30)[i // 2 % 2],
            repetition_penalty=(1.0, 1.3, 0.8)[i % 3], presence_penalty=(0.0, 0.5)[i // 3 % 2],
            frequency_penalty=(0.0, 0.4, -0.3)[i // 4 % 3],
        )  # fmt: skip
        mask = None if i % 5 == 0 else torch.rand(V) < 0.4
        out = [int(t) for t in torch.randint(0, V, (i % 9,))] + [int(logits[i].argmax())] * (i % 2)
        rows.append(RowInput(params, 900 + i, len(out), [int(logits[i].argmax()), 4, 5], out, mask))
    together = draw_masked(logits, rows).tolist()
    assert together == [sample_row(logits[i], rows[i]).token_id for i in range(48)]
    for i, r in enumerate(rows):
        x = _penalised_by_hand(logits[i], r)
        if r.allowed_mask is not None:
            x = torch.where(r.allowed_mask, x, torch.tensor(float("-inf")))
            assert bool(r.allowed_mask[together[i]])
        if r.params.greedy:
            assert together[i] == int(torch.argmax(x))
        else:
            assert together[i] == sample_rows(x[None], [r.params], [draw_seed(r.seed, r.output_index)])[0]
    with pytest.raises(ValueError, match="allows no token"):
        sample_row(logits[1], RowInput(rows[1].params, 1, 0, [], [], torch.zeros(V, dtype=torch.bool)))


def test_top_k_keeps_every_token_at_or_above_the_kth_largest_value_ties_included() -> None:
    """Top-k takes the k-th largest value from a top-k of the widest k in the batch, not from a
    sort of the whole row: the kept set must be the sort's (ties at the k-th value all kept),
    row by row, with rows whose top-k is off left whole."""
    from engine.sampling.sampler import _truncate_rows

    torch.manual_seed(2)
    x = (torch.randn(64, V) * 3).to(torch.bfloat16).float()  # bf16 values: many ties
    ks = [(0, 1, 2, 7, 50, 400, V, V + 3)[i % 8] for i in range(64)]
    got = _truncate_rows(x, ks, [1.0] * 64, [0.0] * 64)
    for i, k in enumerate(ks):
        kth = torch.sort(x[i], descending=True).values[k - 1] if 0 < k < V else float("-inf")
        want = torch.where(x[i] >= kth, x[i], torch.tensor(float("-inf")))
        assert torch.equal(got[i], want), (i, k)
    assert int(torch.isfinite(got[2]).sum()) >= 2  # k = 2: at least two kept, more on a tie
