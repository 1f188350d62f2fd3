"""What `EngineCore.stats` reports to the routers: sequences waiting for admission count
with the KV they will hold (`waiting_tokens`), apart from what running ones hold."""

from __future__ import annotations

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
