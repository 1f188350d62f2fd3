"""The MTP layer's MoE load counters (what EPLB records for it) after a step's drafting: its
tokens over every pass of the chain, and none in a step that drafts nothing."""

from __future__ import annotations

import pytest

from engine.forward_batch import ForwardBatch, SequenceInput
from engine.spec.drafter import DraftRun
from tests.unit.engine.spec.drafting import PROMPTS, decode_step, prefilled


@pytest.mark.parametrize("mode", ["off", "padded"])
def test_the_mtp_load_counts_every_drafting_pass_and_resets_each_step(mode: str) -> None:
    runner, drafter, seqs = prefilled(mode, seed=3)
    k = runner.model_cfg.num_experts_per_tok
    wanted = [3, 1, 0]  # drafts after each run (0: the run only writes the MTP window)
    hidden, runs = decode_step(runner, seqs, 0, wanted)
    drafts = drafter.draft(hidden, runs).result()
    assert [len(drafts[str(i)].tokens) for i in (0, 1)] == [3, 1] and "2" not in drafts
    passes = 3 + sum(max(0, d - 1) for d in wanted)  # pass 1 over the three runs, then the chains
    assert int(drafter.load.sum()) == k * passes
    # a step that drafts nothing leaves no MTP load behind for EPLB to record again
    rows = [SequenceInput([s[n + 1]], n + 1, i, [i]) for i, (s, n) in enumerate(zip(seqs, PROMPTS))]
    runner.execute(ForwardBatch.from_sequences(rows))
    assert int(drafter.load.sum()) == 0


def test_a_prompts_run_drafted_apart_from_the_decodes_is_counted_with_them() -> None:
    """With decode graphs, a prompt's run (longer than a graph takes) drafts eagerly beside the
    graphed chain of the decode rows' runs; the load is both parts'."""
    runner, drafter, seqs = prefilled("padded", seed=3)
    k = runner.model_cfg.num_experts_per_tok
    rows = [SequenceInput([s[n]], n, i, [i]) for i, (s, n) in enumerate(zip(seqs[:2], PROMPTS))]
    rows.append(SequenceInput(seqs[2][PROMPTS[2] : PROMPTS[2] + 8], PROMPTS[2], 2, [2]))
    out = runner.execute(ForwardBatch.from_sequences(rows))
    runs = [
        DraftRun("0", 0, [0], PROMPTS[0], [seqs[0][PROMPTS[0] + 1]], 0, 0, 2),
        DraftRun("1", 1, [1], PROMPTS[1], [seqs[1][PROMPTS[1] + 1]], 1, 0, 2),
        DraftRun("2", 2, [2], PROMPTS[2], [*seqs[2][PROMPTS[2] + 1 : PROMPTS[2] + 8], 7], 2, 0, 2),
    ]
    drafts = drafter.draft(out.hidden, runs).result()
    assert sorted(drafts) == ["0", "1", "2"]
    passes = (1 + 1 + 8) + 3  # pass 1 over every run's tokens, then each chain's second pass
    assert int(drafter.load.sum()) == k * passes
