"""The padded decode batches that CUDA graphs replay (engine/cuda_graphs.py), run eagerly on CPU.

A graph fixes every shape: the batch is padded to a bucket of rows that read and write a
scratch slot and block, attention gathers a bucketed number of compressed entries, and every
row's compressor pools its window whether it closes or not. None of that may change a real
row's logits, its caches, or the MoE load counters. The capture itself runs in tests/gpu.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from engine.cuda_graphs import (
    MAX_GRAPH_QUERY,
    DecodeGraphs,
    batch_bucket,
    context_bucket,
    graphable,
    round_up_eighth,
    token_bucket,
)
from engine.forward_batch import ForwardBatch, SequenceInput
from engine.runner import ModelRunner, RunnerConfig
from tests.unit.engine.conftest import reference_logits

#: nine rows (bucket 10: one padding row), lengths across window, CSA (rate 4) and HCA (rate
#: 16) closings; the decode steps cross HCA windows
PROMPTS, STEPS = [1, 3, 14, 30, 47, 5, 9, 16, 22], 18


def _seqs() -> list[list[int]]:
    return [
        torch.randint(0, 256, (n + STEPS,), generator=torch.Generator().manual_seed(40 + i)).tolist()
        for i, n in enumerate(PROMPTS)
    ]


def _run(
    path, mode: str, seqs: list[list[int]]
) -> tuple[ModelRunner, list[torch.Tensor], list[torch.Tensor]]:
    """Prefill each prompt, then STEPS decode steps of the whole batch: (runner, logits per
    step, the MoE layers' load counters per step)."""
    n = len(seqs)
    runner = ModelRunner(path, RunnerConfig(num_blocks=n, num_slots=n, decode_graphs=mode))
    prefill = [SequenceInput(s[:p], 0, i, [i]) for i, (s, p) in enumerate(zip(seqs, PROMPTS))]
    runner.execute(ForwardBatch.from_sequences(prefill))
    logits, loads = [], []
    for t in range(STEPS):
        dec = [SequenceInput([s[p + t]], p + t, i, [i]) for i, (s, p) in enumerate(zip(seqs, PROMPTS))]
        batch = ForwardBatch.from_sequences(dec)
        assert graphable(batch)
        logits.append(runner.execute(batch).logits.clone())
        loads.append(runner.expert_load().clone())
    return runner, logits, loads


def test_buckets_pad_by_less_than_a_quarter_and_never_shrink() -> None:
    for n in range(1, 5000):
        b = batch_bucket(n)
        assert n <= b < 1.25 * n or n <= 8 and b == n
    assert [batch_bucket(n) for n in (1, 8, 9, 17, 200, 257)] == [1, 8, 10, 20, 224, 320]
    assert [context_bucket(n) for n in (1, 256, 257, 2049, 4097, 131_072)] == [
        256, 256, 512, 2560, 5120, 131_072,
    ]  # fmt: skip
    assert all(context_bucket(n) % 256 == 0 for n in range(1, 20_000, 37))
    assert round_up_eighth(0) == 0


def test_a_verification_graph_holds_its_steps_tokens_not_rows_times_the_longest() -> None:
    """Token buckets pad a step by under half a token a row, whatever its longest row, and a
    row bucket has at most 2 x MAX_GRAPH_QUERY of them."""
    for rows in (1, 2, 8, 10, 64, 128, 320):
        buckets = {token_bucket(t, rows) for t in range(1, rows * MAX_GRAPH_QUERY + 1)}
        assert len(buckets) <= 2 * MAX_GRAPH_QUERY
        for t in range(1, rows * MAX_GRAPH_QUERY + 1):
            assert t <= token_bucket(t, rows) < t + max(1, rows / 2)
    # 64 rows, one verifying five drafts and the others one: 132 tokens in a graph of 160
    # (padding every row to the longest held 384)
    assert token_bucket(6 + 63 * 2, 64) == 160
    assert sum(DecodeGraphs.layout(64, MAX_GRAPH_QUERY, 1, 160)[:3]) == 3 * 160


def test_padded_decode_equals_the_reference_and_the_eager_path(reference) -> None:
    path, ref = reference("mixed_hc2")
    seqs = _seqs()
    eager, want, want_load = _run(path, "off", seqs)
    padded, got, got_load = _run(path, "padded", seqs)
    refs = [reference_logits(ref, torch.tensor(s)) for s in seqs]
    for t in range(STEPS):
        assert (got[t] - want[t]).abs().max().item() < 1e-5, f"step {t}: padded != eager"
        for i, p in enumerate(PROMPTS):
            err = (got[t][i] - refs[i][p + t]).abs().max().item()
            assert err < 1e-4, f"step {t}, sequence {i}: {err} from the reference"
        # padding rows route too, but are not load
        assert torch.equal(got_load[t], want_load[t]), f"step {t}: load counters differ"
    # the real rows of every cache hold what the eager path left (up to fp32 rounding: the
    # padded batch's matmuls have more rows); the scratch block and slot are extra
    n = len(seqs)
    caches = [
        *(("rows", layer, padded.pool.rows[layer], t) for layer, t in eager.pool.rows.items()),
        *(
            ("index rows", layer, padded.pool.index_rows[layer], t)
            for layer, t in eager.pool.index_rows.items()
        ),
        *(("window", layer, padded.swa.window[layer], t) for layer, t in enumerate(eager.swa.window)),
    ]
    for what, layer, got_t, want_t in caches:
        err = (got_t[:n] - want_t).abs().max().item()
        assert err < 1e-5, f"layer {layer}: {what} differ by {err}"
    assert padded.pool.num_blocks == n + 1 and eager.pool.num_blocks == n


def _run_verify(
    path, mode: str, seqs: list[list[int]]
) -> tuple[ModelRunner, list[torch.Tensor], list[torch.Tensor]]:
    """Prefill each prompt, then verification-shaped steps: each row brings 1 to 6
    teacher-forced tokens with logits at every one (a seeded mix, some rows with 1): (runner,
    logits per step, the MoE load counters per step)."""
    n = len(seqs)
    rng = random.Random(5)
    runner = ModelRunner(path, RunnerConfig(num_blocks=n, num_slots=n, decode_graphs=mode))
    prefill = [SequenceInput(s[:p], 0, i, [i]) for i, (s, p) in enumerate(zip(seqs, PROMPTS))]
    runner.execute(ForwardBatch.from_sequences(prefill))
    done = list(PROMPTS)
    logits, loads = [], []
    padding = 0  # steps whose token bucket holds padding tokens
    while all(len(s) - d >= 6 for s, d in zip(seqs, done)):
        rows = []
        for i, s in enumerate(seqs):
            q = rng.choice([1, 1, 2, 3, 4, 5, 6])
            rows.append(SequenceInput(s[done[i] : done[i] + q], done[i], i, [i], num_logits=q))
            done[i] += q
        batch = ForwardBatch.from_sequences(rows)
        assert graphable(batch)
        logits.append(runner.execute(batch).logits.clone())
        loads.append(runner.expert_load().clone())
        padding += token_bucket(batch.num_tokens, batch_bucket(n)) > batch.num_tokens
    assert mode == "off" or padding, "no step had padding tokens"
    return runner, logits, loads


@pytest.mark.parametrize("rows", [9, 8], ids=["a padding row", "no padding row"])
def test_padded_verification_equals_the_eager_path(reference, rows: int) -> None:
    """The rows' tokens packed, then padding tokens up to the token bucket (on a padding row,
    or on the last real row where the row bucket has none): they write only the scratch slot
    and block, so every real token's logits, every cache row and the load counters are the
    eager verification path's."""
    path, _ = reference("mixed_hc2")
    seqs = _seqs()[:rows]
    assert batch_bucket(rows) == 10 if rows == 9 else batch_bucket(rows) == rows
    eager, want, want_load = _run_verify(path, "off", seqs)
    padded, got, got_load = _run_verify(path, "padded", seqs)
    assert len(got) == len(want) >= 3
    for t, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape
        assert (g - w).abs().max().item() < 1e-5, f"step {t}: padded != eager"
        assert torch.equal(got_load[t], want_load[t]), f"step {t}: load counters differ"
    n = len(seqs)
    caches = [
        *(("rows", padded.pool.rows[layer], t) for layer, t in eager.pool.rows.items()),
        *(("index rows", padded.pool.index_rows[layer], t) for layer, t in eager.pool.index_rows.items()),
        *(("window", padded.swa.window[layer], t) for layer, t in enumerate(eager.swa.window)),
        *(("state", padded.swa.state_kv[layer], t) for layer, t in eager.swa.state_kv.items()),
    ]
    for what, got_t, want_t in caches:
        assert (got_t[:n] - want_t).abs().max().item() < 1e-5, what


def _run_mixed(
    path, mode: str, seqs: list[list[int]], one_pass: bool = False
) -> tuple[ModelRunner, list, list[list[int] | None]]:
    """Prefill the first seven prompts, then steps that mix their decode and verification rows
    (1 to 3 teacher-forced tokens, logits at each) with the last two prompts: prompt 8 in two
    chunks (the first not sampled), then prompt 7, each decoding from the step after its
    last chunk: (runner, per step its logits, hidden streams and MoE load, per step the
    sequences `ModelRunner.split` runs first). ``one_pass``: never split."""
    n = len(seqs)
    rng = random.Random(11)
    cfg = RunnerConfig(num_blocks=n, num_slots=n, decode_graphs=mode, split_mixed_steps=not one_pass)
    runner = ModelRunner(path, cfg)
    prefill = [SequenceInput(s[:p], 0, i, [i]) for i, (s, p) in enumerate(zip(seqs[:7], PROMPTS))]
    runner.execute(ForwardBatch.from_sequences(prefill))
    done = list(PROMPTS[:7]) + [0, 0]
    prompts = {0: [(8, 10)], 1: [(8, PROMPTS[8])], 2: [(7, PROMPTS[7])]}  # step -> (sequence, chunk end)
    results, graphed = [], []
    for t in range(5):
        rows = []
        for i, s in enumerate(seqs):
            chunk = [end for seq, end in prompts.get(t, ()) if seq == i]
            if chunk:
                rows.append(
                    SequenceInput(s[done[i] : chunk[0]], done[i], i, [i], sample=chunk[0] == PROMPTS[i])
                )
                done[i] = chunk[0]
            elif done[i] >= PROMPTS[i]:
                q = rng.choice([1, 1, 2, 3])
                rows.append(SequenceInput(s[done[i] : done[i] + q], done[i], i, [i], num_logits=q))
                done[i] += q
        batch = ForwardBatch.from_sequences(rows)
        parts = runner.split(batch)
        graphed.append(None if parts is None else [batch.swa_slot_cpu[i] for i in parts[0][0]])
        out = runner.execute(batch)
        results.append((out.logits.clone(), out.hidden.clone(), runner.expert_load().clone()))
    return runner, results, graphed


def test_a_mixed_step_runs_its_decode_rows_apart_from_its_prompts(reference) -> None:
    """A step of decode and verification rows beside prompt chunks runs as two passes: the
    decode rows (a decode graph's padded batch, or the eager vectorised path), then the
    prompts. Every logit, hidden stream, cache row and load counter is one pass's."""
    path, _ = reference("mixed_hc2")
    seqs = _seqs()
    one, want, not_split = _run_mixed(path, "off", seqs, one_pass=True)
    assert not_split == [None] * 5
    for mode in ("off", "padded"):
        runner, got, first = _run_mixed(path, mode, seqs)
        # steps 0-2 hold a prompt chunk of over 8 tokens each (no vectorised path); 3-4 decode only
        assert first == [list(range(7)), list(range(7)), [*range(7), 8], None, None], mode
        assert runner.split_steps == 4  # and the first prefill: prompt 0 is one token, a decode row
        for t, (g, w) in enumerate(zip(got, want)):
            for what, a, b in zip(("logits", "hidden", "load"), g, w):
                assert a.shape == b.shape, f"{mode}, step {t}: {what}"
                assert (a.float() - b.float()).abs().max().item() < 1e-5, f"{mode}, step {t}: {what} differ"
        n = len(seqs)
        caches = [
            *(("rows", runner.pool.rows[layer], t) for layer, t in one.pool.rows.items()),
            *(("index rows", runner.pool.index_rows[layer], t) for layer, t in one.pool.index_rows.items()),
            *(("window", runner.swa.window[layer], t) for layer, t in enumerate(one.swa.window)),
            *(("state", runner.swa.state_kv[layer], t) for layer, t in one.swa.state_kv.items()),
        ]
        for what, got_t, want_t in caches:
            assert (got_t[:n] - want_t).abs().max().item() < 1e-5, f"{mode}: {what}"


def test_a_split_step_keeps_the_device_tokens_of_its_rows() -> None:
    """`ForwardBatch.select` carries the `fed` tokens (the previous step's, read on the device)
    that fall in the chosen sequences, at their new flat indices."""
    seqs = [SequenceInput([0], 4, 0, [0]), SequenceInput([1, 2, 3], 0, 1, [1]), SequenceInput([0], 9, 2, [2])]
    batch = ForwardBatch.from_sequences(seqs)
    batch = dataclasses.replace(
        batch, fed=(torch.tensor([0, 4]), torch.tensor([70, 71])), fed_cpu=(0, 4)
    )  # the decode rows' tokens
    part, flat = batch.select([1, 2])
    assert flat == [1, 2, 3, 4] and part.fed_cpu == (3,)
    ids = part.input_ids.clone()
    part.write_fed(ids)
    assert ids.tolist() == [1, 2, 3, 71]
    alone, _ = batch.select([1])
    assert alone.fed is None and alone.input_ids.tolist() == [1, 2, 3]


@pytest.mark.parametrize(
    "change",
    [
        dict(sample=False),
        dict(swa_keep=(1, 3)),
        dict(rows_cached_until=4),
        dict(embeds=((0, torch.zeros(1, 64)),)),
        dict(token_ids=list(range(7)), num_logits=7),
    ],
)
def test_only_plain_decode_and_verification_batches_are_graphed(change) -> None:
    base = dict(token_ids=[5], num_computed=7, swa_slot=0, block_table=[0])
    other = SequenceInput([9], 3, 1, [1])
    assert graphable(ForwardBatch.from_sequences([SequenceInput(**base), other]))
    verifying = dict(base, token_ids=[5, 6, 7], num_logits=3)
    assert graphable(ForwardBatch.from_sequences([SequenceInput(**verifying), other]))
    assert not graphable(ForwardBatch.from_sequences([SequenceInput(**{**base, **change}), other]))


def test_runner_config_refuses_an_unknown_graph_mode() -> None:
    with pytest.raises(ValueError, match="decode_graphs"):
        RunnerConfig(decode_graphs="always")
