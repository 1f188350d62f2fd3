"""EPLB end to end on gloo ranks: record -> decide -> move weights layer by layer while a
toy expert-parallel MoE keeps computing; every output must stay bit-identical."""

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
from engine.eplb import ExpertLoadRecorder, ReplicaMap
from services.eplb.controller import EplbConfig, EplbController
from services.eplb.rank import EplbRankRunner

pytestmark = pytest.mark.integration

LAYERS, EXPERTS, DIM, TOKENS, TOP_K, STEPS = 3, 8, 4, 64, 2, 40


def _logical_weight(layer: int, expert: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * layer + expert)
    return torch.randn(DIM, DIM, generator=g)  # [D, D]


class ToyExperts:
    """This rank's expert slots: weights [slots_per_rank, D, D] per layer."""

    def __init__(self, rmap: ReplicaMap, rank: int) -> None:
        self.w = [
            {"w": torch.stack([_logical_weight(layer, int(e)) for e in rmap.local_experts(layer, rank)])}
            for layer in range(LAYERS)
        ]

    def expert_weights(self, layer: int) -> dict[str, torch.Tensor]:
        return self.w[layer]

    def swap_expert_weights(self, layer: int, new: dict[str, torch.Tensor]) -> None:
        self.w[layer] = new


def _route(rng: np.random.Generator, step: int) -> torch.Tensor:
    hot = [1, 6][step >= 20]  # the hot expert drifts half-way
    p = np.full(EXPERTS, 1.0)
    p[hot] = 10.0
    ids = np.stack([rng.choice(EXPERTS, size=TOP_K, replace=False, p=p / p.sum()) for _ in range(TOKENS)])
    return torch.as_tensor(ids)  # [T, k]


def _worker(rank: int, world: int, rendezvous: str, out_dir: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    join_group("gloo", rendezvous, rank, world)
    try:
        cfg = EplbConfig.for_pool("prefill", num_redundant_per_rank=2, window_steps=5, period_steps=15)
        initial = EplbController(cfg, LAYERS, EXPERTS, world).placement.phy2log
        rmap = ReplicaMap(initial, EXPERTS, world)
        experts = ToyExperts(rmap, rank)
        recorder = ExpertLoadRecorder(LAYERS, EXPERTS, cfg.window_steps)
        runner = EplbRankRunner(cfg, experts, recorder, rmap, rank)
        rng = np.random.default_rng(rank)
        x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(rank))  # [T, D]
        for step in range(STEPS):
            for layer in range(LAYERS):
                ids = _route(rng, step)
                recorder.record(layer, ids)
                slots = rmap.map(layer, ids, offset=rank)  # [T, k] physical
                # expert parallel, toy dispatch: gather every rank's slots, index by physical id
                parts = [torch.empty_like(experts.w[layer]["w"]) for _ in range(world)]
                dist.all_gather(parts, experts.w[layer]["w"])
                w_phys = torch.cat(parts)  # [P, D, D]
                y = torch.einsum("tkij,tj->ti", w_phys[slots], x)
                w_log = torch.stack([_logical_weight(layer, e) for e in range(EXPERTS)])
                ref = torch.einsum("tkij,tj->ti", w_log[ids], x)
                assert torch.equal(y, ref), (rank, step, layer)
            recorder.end_step()
            runner.after_step(step)
        table = rmap.phy2log.clone()
        tables = [torch.empty_like(table) for _ in range(world)]
        dist.all_gather(tables, table)
        assert all(torch.equal(t, table) for t in tables), "ranks disagree on the placement"
        Path(out_dir, f"{rank}.json").write_text(
            json.dumps({"moved": runner.layers_moved, "sent": runner.bytes_sent, "phy2log": table.tolist()})
        )
    finally:
        dist.destroy_process_group()


def test_ep2_remaps_during_serving_and_outputs_stay_identical(tmp_path: Path) -> None:
    store = rendezvous_file()  # the ranks' rendezvous, held until they are done
    mp.start_processes(_worker, args=(2, store.path, str(tmp_path)), nprocs=2, join=True, start_method="fork")
    out = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert out[0]["moved"] >= LAYERS  # at least one full remap happened while serving
    assert out[0]["sent"] + out[1]["sent"] > 0
    final = np.array(out[0]["phy2log"])  # [L, P]
    assert ((final == 6).sum(1) >= 2).all()  # the late hot expert got replicas in every layer
