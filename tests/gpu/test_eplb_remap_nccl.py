"""remap_expert_weights and the replica map over NCCL (needs 2 CUDA devices; not run in CI)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.distributed.rendezvous import join_group, rendezvous_file
from engine.eplb import ExpertLoadRecorder, ReplicaMap, remap_expert_weights
from router.eplb.transfer import plan_remap

pytestmark = pytest.mark.gpu
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
one_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

E, R, RED = 16, 2, 2


def _weights(logical: np.ndarray, device: torch.device) -> dict[str, torch.Tensor]:
    ids = torch.as_tensor(logical, dtype=torch.float32, device=device)[:, None, None]
    return {"w13": (ids * 1000 + torch.arange(64, device=device).reshape(1, 8, 8)).to(torch.bfloat16)}


def _worker(rank: int, rendezvous: str) -> None:
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # no NVLink multicast
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    join_group("nccl", rendezvous, rank, R)
    try:
        dist.all_reduce(torch.zeros(1, device=dev))  # p2p must not be the group's first collective
        rng = np.random.default_rng(7)
        old = rng.permutation(np.concatenate([np.arange(E), rng.integers(0, E, R * RED)]))
        new = rng.permutation(np.concatenate([np.arange(E), rng.integers(0, E, R * RED)]))
        s = E // R + RED
        old_w = _weights(old[rank * s : (rank + 1) * s], dev)
        new_w, stats = remap_expert_weights(plan_remap(old, new, R), old_w, rank)
        assert torch.equal(new_w["w13"], _weights(new[rank * s : (rank + 1) * s], dev)["w13"])
        assert stats.bytes_sent + stats.bytes_copied_locally > 0
    finally:
        dist.destroy_process_group()


@two_gpus
def test_nccl_remap_moves_every_slot() -> None:
    store = rendezvous_file()  # the ranks' rendezvous, held until they are done
    mp.spawn(_worker, args=(store.path,), nprocs=R, join=True)


@one_gpu
def test_recorder_and_replica_map_never_sync_with_the_host() -> None:
    dev = torch.device("cuda", 0)
    phy2log = np.concatenate([np.arange(E), np.arange(R * RED)])
    rmap = ReplicaMap(phy2log[None], E, R, device=dev)
    rec = ExpertLoadRecorder(1, E, window=4, device=dev)
    ids = torch.randint(0, E, (4096, 6), device=dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync raises
    try:
        phys = rmap.map(0, ids, offset=1)
        rec.record(0, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(torch.as_tensor(phy2log, device=dev)[phys], ids)
    rec.end_step()
    assert int(rec.window_sum().sum()) == ids.numel()
