"""The shared-prefix workload of ``sluice bench api --replicas``."""

from __future__ import annotations

from collections import Counter

from services.bench._api_routing import BLOCK, workload


def test_workload_shares_exact_prefixes_in_a_seeded_shuffled_order():
    prompts = workload(groups=6, per_group=4, prefix_blocks=2, suffix=10, seed=3)
    assert len(prompts) == 24 and all(len(p) == 2 * BLOCK + 10 for p in prompts)
    groups = Counter(tuple(p[: 2 * BLOCK]) for p in prompts)
    assert sorted(groups.values()) == [4] * 6  # six prefixes, four requests each
    assert len({tuple(p) for p in prompts}) == 24  # suffixes differ
    assert workload(6, 4, 2, 10, seed=3) == prompts and workload(6, 4, 2, 10, seed=4) != prompts
    order = [list(groups).index(tuple(p[: 2 * BLOCK])) for p in prompts]
    # not a fixed interleave: round_robin over 3 replicas must not get group affinity for free
    assert any(order[i] % 3 != order[i + 6] % 3 for i in range(len(order) - 6))
