"""remap_expert_weights across real gloo processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.distributed.rendezvous import join_group, rendezvous_file
from engine.eplb import remap_expert_weights
from router.eplb.transfer import plan_remap

pytestmark = pytest.mark.integration

NUM_LOGICAL = 12
LAYERS = 3


def _random_placement(rng: np.random.Generator, world: int, redundant: int) -> np.ndarray:
    extra = rng.integers(0, NUM_LOGICAL, size=world * redundant)
    return rng.permutation(np.concatenate([np.arange(NUM_LOGICAL), extra]))


def _expert_weights(logical: np.ndarray) -> dict[str, torch.Tensor]:
    """Weights of a rank's slots, each a deterministic function of its logical expert."""
    ids = torch.as_tensor(logical, dtype=torch.float32)[:, None, None]
    w13 = ids * 1000 + torch.arange(24, dtype=torch.float32).reshape(1, 4, 6)  # [s, 4, 6]
    scale = (ids[:, 0, :1] + torch.arange(5, dtype=torch.float32) / 8).to(torch.float16)  # [s, 5]
    return {"w13": w13, "scale": scale}


def _worker(rank: int, world: int, rendezvous: str, redundant: int, out_dir: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # keep gloo's sockets on loopback
    join_group("gloo", rendezvous, rank, world)
    try:
        rng = np.random.default_rng(1234)  # the same placements on every rank
        s = NUM_LOGICAL // world + redundant
        stats = []
        for layer in range(LAYERS):
            old = _random_placement(rng, world, redundant)
            new = _random_placement(rng, world, redundant) if layer else old.copy()
            old_w = _expert_weights(old[rank * s : (rank + 1) * s])
            snapshot = {k: v.clone() for k, v in old_w.items()}
            new_w, st = remap_expert_weights(plan_remap(old, new, world), old_w, rank)
            want = _expert_weights(new[rank * s : (rank + 1) * s])
            for k in want:
                assert torch.equal(new_w[k], want[k]), (rank, layer, k)
                assert torch.equal(old_w[k], snapshot[k]), "old weights must stay intact while serving"
                assert new_w[k].data_ptr() != old_w[k].data_ptr()
            stats.append([st.bytes_sent, st.bytes_received, st.bytes_copied_locally])
        Path(out_dir, f"{rank}.json").write_text(json.dumps(stats))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("world", "redundant"), [(2, 2), (4, 1)])
def test_remap_puts_every_logical_expert_in_every_slot(tmp_path: Path, world: int, redundant: int) -> None:
    torch.set_num_threads(1)
    # fork: the children inherit the imported torch instead of re-importing it (seconds each)
    store = rendezvous_file()  # the ranks' rendezvous, held until they are done
    mp.start_processes(
        _worker,
        args=(world, store.path, redundant, str(tmp_path)),
        nprocs=world,
        join=True,
        start_method="fork",
    )
    per_rank = np.array([json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)])  # [R, L, 3]
    rng = np.random.default_rng(1234)
    row_bytes = 24 * 4 + 5 * 2
    s = NUM_LOGICAL // world + redundant
    for layer in range(LAYERS):
        old = _random_placement(rng, world, redundant)
        new = _random_placement(rng, world, redundant) if layer else old.copy()
        plan = plan_remap(old, new, world)
        sent, received, local = per_rank[:, layer].sum(0)
        assert sent == received == len(plan.transfers) * row_bytes
        assert sent + local == world * s * row_bytes  # every new slot filled exactly once
        if layer == 0:
            assert sent == 0  # unchanged placement: nothing crosses the network
        else:
            assert 0 < sent < world * s * row_bytes  # moves only what is missing
