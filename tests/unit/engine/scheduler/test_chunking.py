from __future__ import annotations

import pytest

from costmodel import CostModel
from engine.scheduler.chunking import largest_chunk, seq_cost
from engine.scheduler.config import SchedulerConfig
from engine.scheduler.request import Request
from engine.scheduler.scheduler import Scheduler


@pytest.mark.parametrize(
    "a,b,d",
    [(1e-8, 1e-5, 0.0), (0.0, 2e-5, 0.0), (5e-8, 0.0, 0.0), (1e-8, 1e-6, 1.4e-5), (0.0, 0.0, 2.4e-4)],
)
@pytest.mark.parametrize("prefix", [0, 1000, 50_000])
@pytest.mark.parametrize("time_left", [0.001, 0.05, 2.0])
def test_largest_chunk_is_the_largest_that_fits(a, b, d, prefix, time_left):
    """Every term of the fitted model counts, the per-new-token ``d`` too (a step linear in
    its new tokens, as the CPU engine's are, fits with a = b = 0)."""
    model = CostModel(a=a, b=b, c=0.001, d=d)
    c = largest_chunk(model, prefix, tokens_left=32_768, time_left=time_left)
    assert 0 <= c <= 32_768
    if c > 0:
        assert seq_cost(model, c, prefix) <= time_left * (1 + 1e-9)
    if c < 32_768:
        assert seq_cost(model, c + 1, prefix) > time_left
    assert seq_cost(model, max(c, 1), prefix) == pytest.approx(model.predict(max(c, 1), prefix) - model.c)


def test_token_budget_caps_and_no_time_budget_means_token_budget():
    model = CostModel(a=1e-9, b=1e-6, c=0.0)
    assert largest_chunk(model, 0, 100, None) == 100
    assert largest_chunk(model, 0, 100, 10.0) == 100
    assert largest_chunk(model, 0, 0, 10.0) == 0


def test_scheduler_splits_a_long_prompt_by_predicted_time():
    model = CostModel(a=1e-7, b=1e-5, c=0.002)
    cfg = SchedulerConfig(
        num_blocks=100, num_swa_slots=4, block_size=16, step_time_budget_s=0.02, cost_model=model
    )
    sched = Scheduler(cfg)
    sched.add_request(Request("long", list(range(1, 1201)), 1))
    chunks = []
    for _ in range(50):
        out = sched.schedule()
        if out.is_empty:
            break
        (seq,) = out.seqs
        chunks.append((seq.num_new, seq.start_pos))
        assert out.predicted_time_s <= 0.02 + 1e-12
        if seq.sample:
            break
    assert sum(n for n, _ in chunks) == 1200
    assert len(chunks) > 2
    # Later chunks attend to a longer prefix, so they get smaller under the same budget.
    assert chunks[0][0] > chunks[-2][0]


def test_time_budget_without_a_cost_model_is_rejected():
    with pytest.raises(ValueError, match="cost_model"):
        SchedulerConfig(num_blocks=1, num_swa_slots=1, step_time_budget_s=0.1)
