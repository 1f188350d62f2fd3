"""What the drafter hands a confidence head that reads the draft distribution and the draft's
position: each pass's own logits and its position in the chain, eagerly and in the padded
(graph-shaped) chain alike."""

from __future__ import annotations

import pytest
import torch

from engine.model.confidence import ConfidenceConfig, ConfidenceHead
from engine.runner import ModelRunner, RunnerConfig
from tests.unit.engine.spec.drafting import MODEL, decode_step, prefilled

WANTED = [5, 3, 1]  # drafts after each sequence's run


def _drafts(mode: str, head: ConfidenceHead | None) -> dict[str, tuple[tuple[int, ...], tuple[float, ...]]]:
    runner, drafter, seqs = prefilled(mode, seed=5, head=head)
    drafts = drafter.draft(*decode_step(runner, seqs, 0, WANTED)).result()
    return {k: (d.tokens, d.confidence) for k, d in drafts.items()}


def _head(log_p_max: float, position_bias: list[float]) -> ConfidenceHead:
    """A head reading ``[h ; e ; softmax ; position]`` whose only non-zero weights are on the
    log top probability and the positions."""
    hidden = ModelRunner(MODEL, RunnerConfig(num_blocks=1, num_slots=1)).model_cfg.hidden_size
    head = ConfidenceHead(ConfidenceConfig(hidden, softmax=True, positions=5))
    with torch.no_grad():
        head.confidence.weight.zero_()
        head.confidence.weight[0, 2 * hidden] = log_p_max
        head.confidence.bias.zero_()
        head.position_bias.copy_(torch.tensor(position_bias))
    return head.eval()


@pytest.mark.parametrize("mode", ["off", "padded"])
def test_a_head_reading_the_softmax_gets_each_passs_own_distribution(mode: str) -> None:
    """Without a head a draft's confidence is its top probability ``p``; a head of weight 1 on
    ``log p`` gives ``sigmoid(log p) = p / (1 + p)`` for the same draft."""
    plain = _drafts(mode, None)
    soft = _drafts(mode, _head(1.0, [0.0] * 5))
    assert plain.keys() == soft.keys() == {"0", "1", "2"}
    for rid, (tokens, conf) in plain.items():
        assert soft[rid][0] == tokens and len(tokens) == WANTED[int(rid)]
        want = [p / (1 + p) for p in conf]
        assert soft[rid][1] == pytest.approx(want, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("mode", ["off", "padded"])
def test_a_head_reading_the_position_gets_each_drafts_place_in_the_chain(mode: str) -> None:
    bias = [-2.0, -1.0, 0.0, 1.0, 2.0]
    drafts = _drafts(mode, _head(0.0, bias))
    for rid, (_, conf) in drafts.items():
        want = [float(torch.sigmoid(torch.tensor(b))) for b in bias[: WANTED[int(rid)]]]
        assert conf == pytest.approx(want, rel=1e-6)


class _Refuses(ConfidenceHead):
    def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("a step that drafts nothing ran the confidence head")


@pytest.mark.parametrize("mode", ["off", "padded"])
def test_a_step_that_drafts_nothing_writes_the_window_and_runs_no_head(mode: str) -> None:
    """Speculation off: pass 1 still writes each run's MTP window, but no draft is taken and
    no head runs. The next step's drafts are those after a step that drafted one each."""
    after: dict[int, dict[str, tuple[int, ...]]] = {}
    hidden_size = ModelRunner(MODEL, RunnerConfig(num_blocks=1, num_slots=1)).model_cfg.hidden_size
    for first in (0, 1):
        runner, drafter, seqs = prefilled(mode, seed=5, head=_Refuses(ConfidenceConfig(hidden_size)))
        drafts: dict[str, tuple[int, ...]] = {}
        for step, wanted in ((0, first), (1, 3)):
            if wanted:
                drafter.head = None  # the head is not what this test is about
            got = drafter.draft(*decode_step(runner, seqs, step, [wanted] * 3)).result()
            assert (got == {}) == (wanted == 0)
            drafts = {k: d.tokens for k, d in got.items()}
        after[first] = drafts
    assert after[0] == after[1] and all(len(t) == 3 for t in after[0].values())
