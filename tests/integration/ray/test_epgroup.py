"""An EP group of 2 Ray actors (gloo over loopback, in one placement group) on the tiny
checkpoint gives the logits of a single-rank ``ModelRunner``, each rank running its own
sequence (data-parallel attention), and also when a rank has no tokens; after ``shutdown``
neither its actors nor its placement group remain."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.forward_batch import ForwardBatch, SequenceInput
from engine.runner import ModelRunner, RunnerConfig

# Not `timing`: the one wall-clock bound here (the collective timeout) only tells a timeout from
# a hang, 4x wide, so the file runs in the parallel pass's Ray unit, on its cluster, instead of
# starting a second cluster in the `timing` pass (24 s of that pass's single-process time).
pytestmark = pytest.mark.integration

RUNNER = {"num_blocks": 2, "num_slots": 1}
ATOL = 1e-4


def prompt_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def steps_of(ids: list[int]) -> list[list[SequenceInput]]:
    """Prefill in two chunks, then two single-token decode steps, on block 0 and slot 0."""
    cut = [0, 17, len(ids) - 2, len(ids) - 1, len(ids)]
    return [[SequenceInput(ids[a:b], a, 0, [0])] for a, b in zip(cut, cut[1:])]


def single(runner: ModelRunner, steps: list[list[SequenceInput]]) -> list[np.ndarray]:
    return [runner.execute(ForwardBatch.from_sequences(s)).logits.numpy() for s in steps]


@pytest.fixture(scope="module")
def model(checkpoint_factory) -> Path:
    return checkpoint_factory("tiny")


@pytest.fixture(scope="module")
def ref(model) -> ModelRunner:
    torch.set_num_threads(1)
    return ModelRunner(model, RunnerConfig(**RUNNER))


@pytest.fixture(scope="module")
def group(ray_local, model) -> Iterator[object]:
    from services.ray.epgroup import EPGroup

    g = EPGroup(str(model), 2, RUNNER, timeout_s=5.0)
    yield g
    g.shutdown()


def test_group_is_two_gloo_ranks_in_one_placement_group(group) -> None:
    import ray
    from ray.util import placement_group_table

    assert [i["rank"] for i in group.info] == [0, 1]
    assert {i["backend"] for i in group.info} == {"gloo"}
    assert len({i["pid"] for i in group.info}) == 2  # two processes
    table = placement_group_table(group.pg)
    assert table["state"] == "CREATED" and table["strategy"] == "STRICT_PACK"
    assert len(table["bundles"]) == 2
    assert ray.available_resources().get("CPU", 0) == 0  # both CPUs of the loopback cluster held


def test_each_rank_its_own_sequence_equals_one_rank(group, ref) -> None:
    prompts = [prompt_of(1, 30), prompt_of(2, 39)]
    per_rank = [steps_of(p) for p in prompts]
    want = [single(ref, s) for s in per_rank]
    for step in range(4):
        got = group.execute([per_rank[0][step], per_rank[1][step]])
        for rank in range(2):
            assert got[rank].dtype == np.float32 and got[rank].shape == (1, 1024)
            np.testing.assert_allclose(got[rank], want[rank][step], atol=ATOL, rtol=0)


@pytest.mark.parametrize("busy", [0, 1])
def test_rank_without_tokens_still_serves_its_experts(group, ref, busy) -> None:
    steps = steps_of(prompt_of(10 + busy, 35))
    want = single(ref, steps)
    for step, seqs in enumerate(steps):
        batches = [None, None]
        batches[busy] = seqs
        got = group.execute(batches)
        assert got[1 - busy].shape == (0, 1024)  # the idle rank: no logits
        np.testing.assert_allclose(got[busy], want[step], atol=ATOL, rtol=0)


def test_shutdown_leaves_no_actor_or_placement_group(group) -> None:
    """Last in this module: shuts the module's group down (its fixture's own shutdown is then
    a no-op)."""
    import ray
    from ray._private import state
    from ray.util import placement_group_table

    pg_id = group.pg.id.hex()
    actor_ids = {a._actor_id.hex() for a in group.actors}
    assert group.execute([steps_of(prompt_of(3, 20))[0], None])[0].shape == (1, 1024)
    group.shutdown()
    group.shutdown()  # a second call is a no-op
    assert placement_group_table()[pg_id]["state"] == "REMOVED"
    deadline = time.monotonic() + 15  # Ray frees what the actors held asynchronously
    while True:
        alive = {aid for aid, a in state.actors().items() if a["State"] != "DEAD"} & actor_ids
        cpus = ray.available_resources().get("CPU", 0)
        if (not alive and cpus == 2) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert actor_ids and not alive
    assert cpus == 2  # both CPUs of the loopback cluster given back


def test_a_rank_left_waiting_gives_up_within_the_collective_timeout(ray_local, model) -> None:
    """Only rank 0 steps (rank 1 is alive but never enters the MoE layers): rank 0's
    all-to-all fails after the group's 5 s timeout instead of hanging."""
    import ray

    from services.ray.epgroup import EPGroup

    g = EPGroup(str(model), 2, RUNNER, timeout_s=5.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(ray.exceptions.RayTaskError):
            ray.get(g.actors[0].execute.remote(steps_of(prompt_of(4, 20))[0]), timeout=60)
        assert 4.0 < time.monotonic() - t0 < 20.0  # past the 5 s timeout, and no hang
    finally:
        g.shutdown()
