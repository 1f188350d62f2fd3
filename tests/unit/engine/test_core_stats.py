"""What `EngineCore.stats` reports to the routers: sequences waiting for admission count
with the KV they will hold (`waiting_tokens`), apart from what running ones hold; and the
decode steps it ran, speculating or not, summed for the decode cost model."""

from __future__ import annotations

import pytest

from engine.core import CoreRequest, EngineConfig, EngineCore
from engine.sampling.params import SamplingParams


def test_waiting_sequences_report_the_kv_they_will_hold(checkpoint_factory) -> None:
    core = EngineCore(EngineConfig(model=str(checkpoint_factory("tiny")), max_num_seqs=1))
    try:
        lengths = (40, 70, 130)
        for i, n in enumerate(lengths):
            core.add(CoreRequest(f"r{i}", tuple(range(3, 3 + n)), SamplingParams(max_tokens=4)))
        core.step()
        st = core.stats()
        assert (st.running, st.waiting) == (1, 2)
        assert st.kv_tokens == lengths[0]  # the running one's prompt, computed
        assert st.extra["waiting_tokens"] == sum(lengths[1:])
    finally:
        core.close()


def test_plain_decode_steps_are_summed_for_the_routers_decode_cost_model(checkpoint_factory) -> None:
    """Every plain decode step, and no step that computed a prompt, is in the sums the
    engine pushes (`costmodel.online`), with the KV tokens it read and the times the engine
    loop recorded; a model refitted to them comes to this engine's steps."""
    from costmodel import DecodeCostModel
    from costmodel.online import DecodeStepSums, posterior

    core = EngineCore(EngineConfig(model=str(checkpoint_factory("tiny")), max_num_seqs=8))
    try:
        core.add(CoreRequest("first", tuple(range(3, 43)), SamplingParams(max_tokens=4, ignore_eos=True)))
        core.step()  # the prompt, and the first token
        assert DecodeStepSums.from_extra(core.stats().extra).w == 0
        core.step()  # one decode step: one sequence, its 40 prompt tokens in the caches
        sums = DecodeStepSums.from_extra(core.stats().extra)
        assert sums.w == 1 and sums.batch == 1 and sums.kv == 40 and sums.t > 0
        for i, n in enumerate((20, 90, 150, 300, 60, 200)):  # staggered: batches of 1 to 6
            core.add(CoreRequest(f"r{i}", tuple(range(3, 3 + n)), SamplingParams(max_tokens=8 + 4 * i, ignore_eos=True)))  # fmt: skip
            core.step()
        while core.has_work():
            core.step()
        stats = list(core.loop.stats)
        plain = [s for s in stats if s.prefill_tokens == 0 and s.decode_tokens]
        sums = DecodeStepSums.from_extra(core.stats().extra)
        assert len(plain) < len(stats)
        assert sums.w == pytest.approx(len(plain), rel=0.01)  # (fading: 2^(-n / 4096) per step)
        assert sums.batch == pytest.approx(sum(s.decode_tokens for s in plain), rel=0.01)
        # the relative-error sums are of the steps' own times (`EngineLoop.stats` has them)
        seconds = [s.seconds for s in plain]
        assert sums.t == pytest.approx(sum(seconds), rel=0.01)
        assert sums.b[0] == pytest.approx(sum(1 / t for t in seconds), rel=0.01)
        assert sums.b[1] == pytest.approx(sum(s.decode_tokens / s.seconds for s in plain), rel=0.01)
        assert sums.a[1, 1] == pytest.approx(sum((s.decode_tokens / s.seconds) ** 2 for s in plain), rel=0.01)
        # refitted, a model is never worse than its prior; with a loose prior it is at least
        # as good as the best constant step time, one of the models it chooses among (how far
        # the H200 default is from this machine, and how the steps spread with what else runs,
        # are not asserted)
        default = DecodeCostModel()
        assert sums.rel_rmse(posterior(default, sums)) <= sums.rel_rmse(default) * (1 + 1e-9)
        best_constant = DecodeCostModel(d0=sums.b[0] / sums.a[0, 0], d1=0.0, d2=0.0)
        loose = posterior(default, sums, prior_rel_sd=1e3)
        assert sums.rel_rmse(loose) <= sums.rel_rmse(best_constant) * (1 + 1e-6)
    finally:
        core.close()


def test_speculating_steps_are_summed_whole_per_sequence() -> None:
    """A speculating engine's decode steps (drafting, and verifying the drafts of the step
    before) are in the sums too, whole and counted in sequences: a sequence's share of a
    step, which the router's 2D rule weighs, holds the drafts it verifies."""
    from costmodel.online import DecodeStepSums
    from engine.checkpoint.presets import SHIPPED

    core = EngineCore(EngineConfig(model=str(SHIPPED["trained"]), max_num_seqs=4, speculative="fixed-3"))
    try:
        prompt = tuple(range(100, 160))
        core.add(CoreRequest("one", prompt, SamplingParams(max_tokens=24, ignore_eos=True)))
        while core.has_work():
            core.step()
        stats = list(core.loop.stats)
        decode = [s for s in stats if s.prompt_tokens == 0 and s.decode_tokens + s.prefill_tokens > 0]
        verifying = [s for s in decode if s.prefill_tokens > 0]  # a row of 1 + drafts tokens
        assert verifying and len(decode) < len(stats)
        sums = DecodeStepSums.from_extra(core.stats().extra)
        assert sums.w == pytest.approx(len(decode), rel=0.01)
        assert sums.batch == pytest.approx(len(decode), rel=0.01)  # one sequence a step, however many tokens
        assert sum(s.decode_tokens + s.prefill_tokens for s in decode) > len(decode)
        assert sums.t == pytest.approx(sum(s.seconds for s in decode), rel=0.01)
    finally:
        core.close()
