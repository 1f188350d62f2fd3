"""Serving-cache behaviours: prefix hits through shared blocks + copied SWA slots, exact SWA-state
rebuild by replay, and the MTP draft head running on the caches."""

from __future__ import annotations

import torch

from engine.forward_batch import ForwardBatch, SequenceInput
from engine.runner import ModelRunner, RunnerConfig
from tests.unit.engine.conftest import reference_logits

NAME = "mixed_hc2"  # 4 layers, window 16, CSA 4, HCA 16
PREFIX = 256


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(runner: ModelRunner, seq: SequenceInput) -> torch.Tensor:
    return runner.execute(ForwardBatch.from_sequences([seq])).logits


def _prefill_prefix(runner: ModelRunner, prefix: list[int]) -> None:
    for a in range(0, PREFIX, 100):
        b = min(PREFIX, a + 100)
        _run(runner, SequenceInput(prefix[a:b], a, 0, [0], sample=False))


def test_prefix_hit_shares_blocks_and_copies_the_slot(reference) -> None:
    path, ref = reference(NAME)
    runner = ModelRunner(path, RunnerConfig(num_blocks=4, num_slots=3))
    prefix = _ids(PREFIX, 1)
    _prefill_prefix(runner, prefix)
    runner.copy_slot(0, 1)
    shared = {k: v[0].clone() for k, v in runner.pool.rows.items()}
    for slot, blocks, seed in ((1, [0, 2], 2), (0, [0, 1], 3)):
        suffix = _ids(20, seed)
        want = reference_logits(ref, torch.tensor(prefix + suffix))
        got = _run(runner, SequenceInput(suffix[:19], PREFIX, slot, blocks))
        assert (got[0] - want[-2]).abs().max().item() < 1e-4
        got = _run(runner, SequenceInput(suffix[19:], PREFIX + 19, slot, blocks))
        assert (got[0] - want[-1]).abs().max().item() < 1e-4
    for k, v in shared.items():  # full shared blocks are never rewritten
        assert torch.equal(runner.pool.rows[k][0], v)


def _replay_then_decode(
    runner: ModelRunner, prefix: list[int], suffix: list[int], replay: int
) -> torch.Tensor:
    s = PREFIX - replay
    # a fresh slot: replay [s, PREFIX) without rewriting the cached rows, window starting at s
    _run(
        runner, SequenceInput(prefix[s:], s, 2, [0, 3], sample=False, rows_cached_until=PREFIX, window_from=s)
    )
    return _run(runner, SequenceInput(suffix, PREFIX, 2, [0, 3]))[0]


def test_swa_slot_rebuilt_exactly_by_replaying_layers_times_window(reference) -> None:
    """Exact rebuild needs num_layers * (window - 1) replayed tokens; one window is approximate."""
    path, ref = reference(NAME)
    runner = ModelRunner(path, RunnerConfig(num_blocks=4, num_slots=3))
    cfg = runner.model_cfg
    prefix, suffix = _ids(PREFIX, 1), _ids(5, 4)
    _prefill_prefix(runner, prefix)
    want = reference_logits(ref, torch.tensor(prefix + suffix))[-1]
    exact = cfg.num_hidden_layers * (cfg.sliding_window - 1)
    got = _replay_then_decode(runner, prefix, suffix, exact)
    assert (got - want).abs().max().item() < 1e-4
    runner.swa.window[0][2].fill_(123.0)  # stale state from another occupant must not leak in
    approx = _replay_then_decode(runner, prefix, suffix, cfg.sliding_window - 1)
    assert (approx - want).abs().max().item() > 1e-4


def test_mtp_draft_runs_on_the_caches_chunked_equals_one_shot(reference) -> None:
    path, _ = reference(NAME)
    ids = _ids(60, 7)
    nxt = ids[1:] + [5]
    one = ModelRunner(path, RunnerConfig(num_blocks=1, num_slots=1))
    batch = ForwardBatch.from_sequences([SequenceInput(ids, 0, 0, [0])])
    out = one.execute(batch)
    want, streams = one.draft(out.hidden, torch.tensor(nxt), batch)
    assert want.shape == (1, one.model_cfg.vocab_size) and streams.shape == out.hidden.shape
    m = one.model.mtp[0]
    with torch.no_grad():
        all_pos = one.model.lm_head(m.norm(m.hc_head(streams))).float()
    chunked = ModelRunner(path, RunnerConfig(num_blocks=1, num_slots=1))
    pos = 0
    for c in (7, 25, 1, 20, 1, 1, 5):
        b = ForwardBatch.from_sequences([SequenceInput(ids[pos : pos + c], pos, 0, [0])])
        o = chunked.execute(b)
        got, _ = chunked.draft(o.hidden, torch.tensor(nxt[pos : pos + c]), b)
        pos += c
        assert (got[0] - all_pos[pos - 1]).abs().max().item() < 1e-4
    assert pos == len(ids)
    again = ModelRunner(path, RunnerConfig(num_blocks=1, num_slots=1))
    rerun, _ = again.draft(again.execute(batch).hidden, torch.tensor(nxt), batch)
    assert torch.equal(rerun, want)  # deterministic: same inputs, bitwise the same logits
