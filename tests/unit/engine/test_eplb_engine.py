"""Engine EPLB pieces without a network: recorder, replica map, remap plan."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.eplb import ExpertLoadRecorder, ReplicaMap, choose_replicas
from router.eplb import Placement, split_counts
from router.eplb.simulate import RecordedLoads
from router.eplb.transfer import RemapPlan, plan_remap


def test_recorder_keeps_a_sliding_window_of_closed_steps(tmp_path) -> None:
    rec = ExpertLoadRecorder(num_layers=2, num_experts=4, window=3, keep_history=True)
    for step in range(5):
        rec.record(0, torch.tensor([[step % 4, (step + 1) % 4]]))
        rec.record(0, torch.tensor([[0, 0]]))  # a second batch in the same step adds up
        rec.record(1, torch.tensor([[3, 2], [3, 1]]))
        rec.end_step()
    rec.record(0, torch.tensor([[1, 1]]))  # open step: not exported
    rec.record_counts(1, torch.tensor([5, 0, 0, 0]))
    win = rec.window_counts()
    assert win.shape == (3, 2, 4)
    for i, step in enumerate((2, 3, 4)):  # oldest first
        want = np.zeros(4, dtype=np.int64)
        want[[step % 4, (step + 1) % 4]] += 1
        want[0] += 2
        assert win[i, 0].tolist() == want.tolist()
        assert win[i, 1].tolist() == [0, 1, 1, 2]
    assert rec.window_sum().tolist() == win.sum(0).tolist()
    assert rec.history().shape == (5, 2, 4)
    rec.dump(str(tmp_path / "loads.npz"))
    assert RecordedLoads.load(str(tmp_path / "loads.npz")).num_steps == 5


def test_recorder_history_needs_opt_in() -> None:
    with pytest.raises(ValueError, match="keep_history"):
        ExpertLoadRecorder(1, 2, 2).history()


@pytest.mark.parametrize("offset", [0, 1, 3])
def test_replica_map_splits_tokens_exactly_as_the_router_model(offset: int) -> None:
    rng = np.random.default_rng(offset)
    phy2log = np.array([[0, 3, 1, 3, 2, 3, 0, 4, 3, 5, 6, 7]])  # expert 3 x4, expert 0 x2
    rmap = ReplicaMap(phy2log, num_logical=8, num_ranks=3)
    placement = Placement.from_phy2log(phy2log, 8, 3)
    topk = torch.as_tensor(rng.integers(0, 8, size=(37, 2)))
    phys = rmap.map(0, topk, offset=offset)
    assert (torch.as_tensor(phy2log[0])[phys] == topk).all()  # every token reaches its expert
    got = np.bincount(phys.reshape(-1).numpy(), minlength=12)
    counts = np.bincount(topk.reshape(-1).numpy(), minlength=8)
    want = split_counts(counts[phy2log[0]], placement.logcnt[0][phy2log[0]], placement.replica[0], offset)
    assert got.tolist() == want.tolist()
    # the first pick of expert 3 goes to replica `offset % 4`, deterministically
    first = int(np.flatnonzero(topk.reshape(-1).numpy() == 3)[0])
    assert int(phys.reshape(-1)[first]) == placement.log2phy[0, 3, offset % 4]
    assert torch.equal(phys, rmap.map(0, topk, offset=offset))
    assert torch.equal(phys, choose_replicas(rmap.log2phy(0), rmap.logcnt(0), topk, offset))


def test_replica_map_update_layer_and_validation() -> None:
    rmap = ReplicaMap(np.array([[0, 1, 2, 3], [0, 1, 2, 3]]), num_logical=4, num_ranks=2)
    rmap.update_layer(1, np.array([3, 2, 1, 0]))
    assert rmap.map(1, torch.tensor([[0, 3]])).tolist() == [[3, 0]]
    assert rmap.map(0, torch.tensor([[0, 3]])).tolist() == [[0, 3]]
    assert rmap.local_experts(1, 1).tolist() == [1, 0]
    with pytest.raises(ValueError, match="every logical expert"):
        rmap.update_layer(0, np.array([0, 0, 1, 2]))


def test_plan_moves_only_what_is_missing_and_spreads_sources() -> None:
    old = np.array([0, 1, 2, 3, 4, 5, 6, 7])  # 2 ranks x 4 slots
    assert plan_remap(old, old, 2).transfers == ()
    new = np.array([0, 1, 4, 4, 2, 3, 5, 6])  # rank 0 needs 4 (twice), rank 1 needs 2 and 3
    plan = plan_remap(old, new, 2)
    moves = {
        (t.src_rank, t.dst_rank, int(old[t.src_rank * 4 + t.src_local]), t.dst_local) for t in plan.transfers
    }
    assert moves == {(1, 0, 4, 2), (0, 1, 2, 0), (0, 1, 3, 1)}
    assert plan.dup == ((0, 2, 3),)  # second copy of expert 4 is a local duplicate
    assert set(plan.local) == {(0, 0, 0), (0, 1, 1), (1, 1, 2), (1, 2, 3)}
    # a replicated expert is fetched from the holder that has sent least
    old2 = np.array([0, 1, 0, 2, 3, 0])  # expert 0 on all three ranks
    plan2 = plan_remap(old2, np.array([1, 2, 3, 3, 0, 1]), 3)
    assert len({t.src_rank for t in plan2.transfers}) > 1
    with pytest.raises(ValueError, match="does not"):
        plan_remap(np.array([0, 1]), np.array([0, 2]), 1)


def test_plan_round_trips_through_plain_arrays() -> None:
    plan = plan_remap(np.array([0, 1, 2, 3, 4, 5]), np.array([5, 5, 0, 3, 1, 2]), 3)
    arrays = plan.to_arrays()
    assert all(a.dtype == np.int64 for a in arrays.values())
    assert RemapPlan.from_arrays(arrays) == plan
    with pytest.raises(ValueError, match="must be"):
        RemapPlan.from_arrays({**arrays, "local": np.zeros((2, 2))})


def test_record_counts_adds_to_the_open_step() -> None:
    rec = ExpertLoadRecorder(num_layers=1, num_experts=3, window=2)
    rec.record_counts(0, torch.tensor([1, 2, 3]))
    rec.record(0, torch.tensor([[2]]))
    rec.end_step()
    assert rec.window_counts().tolist() == [[[1, 2, 4]]]
