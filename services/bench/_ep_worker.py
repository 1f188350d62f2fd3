"""One EP rank of `sluice bench ep`: prefill and decode throughput, then EPLB live.

Attention is data-parallel (each rank its own batch of the same size), experts are split over
the ranks and exchanged with all-to-all (`engine.distributed.ep`). Every timed step is the
slowest rank's (all-reduce MAX of per-rank times measured between device synchronisations).
Weights are seeded random values drawn on the device (`ModelRunner.random`).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from engine.checkpoint.presets import preset_config
from engine.config import BLOCK_TOKENS, ModelConfig
from engine.distributed.rendezvous import join_group
from engine.forward_batch import ForwardBatch, SequenceInput
from engine.runner import ModelRunner, RunnerConfig
from router.eplb.metric import imbalance_matrix
from router.eplb.placement import Placement
from router.eplb.split import rank_loads
from services.bench import progress
from services.eplb.controller import EplbConfig
from services.eplb.engine import EngineEplb, initial_placement
from services.eplb.rank import EplbRankRunner


@dataclass(frozen=True)
class WorkerArgs:
    device: str
    preset: str
    layers: int
    experts: int | None
    dtype: str
    prefill_tokens: int
    prefill_seqs: int
    decode_batches: tuple[int, ...]
    decode_context: int
    decode_steps: int
    warmup: int
    repeats: int
    eplb_steps: int
    eplb_window: int
    eplb_period: int
    eplb_redundant: int
    zipf: float
    seed: int


class Rank:
    """Device, group and timing helpers of one rank."""

    def __init__(self, rank: int, world: int, device: str) -> None:
        self.rank, self.world = rank, world
        self.device = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def max_over_ranks(self, value: float) -> float:
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def sum_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(t)
        return t

    def timed(self, fn: Any, *args: Any) -> float:
        """Seconds of ``fn(*args)`` on the slowest rank."""
        self.sync()
        if self.world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        fn(*args)
        self.sync()
        return self.max_over_ranks(time.perf_counter() - t0)

    def log(self, msg: str) -> None:
        if self.rank == 0:
            progress(f"EP{self.world}: {msg}")


def model_config(a: WorkerArgs) -> ModelConfig:
    over: dict[str, Any] = {"num_hidden_layers": a.layers}
    if a.experts is not None:
        over["n_routed_experts"] = a.experts
    return ModelConfig.from_dict(preset_config(a.preset, **over))


class Tokens:
    """Zipf-distributed token ids over a fixed random permutation of the vocabulary (text-like
    skew: a few ids are frequent), drawn per (rank, step) so ranks see different batches."""

    def __init__(self, vocab: int, zipf: float, seed: int) -> None:
        ranks = np.arange(1, vocab + 1, dtype=np.float64)
        p = ranks**-zipf if zipf > 0 else np.ones(vocab)
        self.p = p / p.sum()
        self.ids = np.random.default_rng(seed).permutation(vocab)
        self.seed = seed

    def draw(self, n: int, rank: int, step: int) -> list[int]:
        rng = np.random.default_rng([self.seed, rank, step])
        return self.ids[rng.choice(len(self.ids), size=n, p=self.p)].tolist()


def _blocks(n_tokens: int) -> int:
    return -(-n_tokens // BLOCK_TOKENS)


def prefill_batch(a: WorkerArgs, toks: Tokens, r: Rank, step: int, device: torch.device) -> ForwardBatch:
    per_seq = a.prefill_tokens // a.prefill_seqs
    nb = _blocks(per_seq)
    ids = toks.draw(per_seq * a.prefill_seqs, r.rank, step)
    seqs = [
        SequenceInput(ids[i * per_seq : (i + 1) * per_seq], 0, i, list(range(i * nb, (i + 1) * nb)))
        for i in range(a.prefill_seqs)
    ]
    return ForwardBatch.from_sequences(seqs, device=device)


def bench_prefill(runner: ModelRunner, a: WorkerArgs, toks: Tokens, r: Rank) -> dict[str, Any]:
    times = []
    for i in range(a.warmup + a.repeats):
        batch = prefill_batch(a, toks, r, i, r.device)
        t = r.timed(runner.execute, batch)
        if i >= a.warmup:
            times.append(t)
    med = statistics.median(times)
    r.log(f"prefill {a.prefill_tokens} tokens/rank: {med * 1e3:.1f} ms (slowest rank, median)")
    return {
        "step_ms": [t * 1e3 for t in times],
        "median_ms": med * 1e3,
        "tok_per_s_per_gpu": a.prefill_tokens / med,
    }


def bench_decode(runner: ModelRunner, a: WorkerArgs, toks: Tokens, r: Rank, b: int) -> dict[str, Any]:
    """``b`` requests per rank: prefill ``decode_context`` tokens each (untimed), then decode steps."""
    ctx, steps = a.decode_context, a.warmup + a.decode_steps
    nb = _blocks(ctx + steps)
    tables = [list(range(i * nb, (i + 1) * nb)) for i in range(b)]
    per_batch = max(1, a.prefill_tokens // ctx)
    for s0 in range(0, b, per_batch):
        ids = toks.draw(ctx * min(per_batch, b - s0), r.rank, 10_000 + s0)
        seqs = [
            SequenceInput(ids[j * ctx : (j + 1) * ctx], 0, s0 + j, tables[s0 + j])
            for j in range(len(ids) // ctx)
        ]
        runner.execute(ForwardBatch.from_sequences(seqs, device=r.device))
    times = []
    for s in range(steps):
        nxt = toks.draw(b, r.rank, 20_000 + s)
        batch = ForwardBatch.from_sequences(
            [SequenceInput([nxt[i]], ctx + s, i, tables[i]) for i in range(b)], device=r.device
        )
        t = r.timed(runner.execute, batch)
        if s >= a.warmup:
            times.append(t)
    med = statistics.median(times)
    r.log(f"decode {b} requests/rank: {med * 1e3:.2f} ms/step")
    return {"requests_per_rank": b, "median_step_ms": med * 1e3, "tok_per_s_per_gpu": b / med}


def throughput(mcfg: ModelConfig, a: WorkerArgs, r: Rank, group: Any) -> dict[str, Any]:
    per_seq = a.prefill_tokens // a.prefill_seqs
    bmax = max(a.decode_batches, default=1)
    blocks = max(
        a.prefill_seqs * _blocks(per_seq), bmax * _blocks(a.decode_context + a.warmup + a.decode_steps)
    )
    rcfg = RunnerConfig(
        num_blocks=blocks, num_slots=max(bmax, a.prefill_seqs), dtype=a.dtype, device=str(r.device),
        with_mtp=False, ep_size=r.world, ep_rank=r.rank,
    )  # fmt: skip
    t0 = time.perf_counter()
    runner = ModelRunner.random(mcfg, rcfg, group, seed=a.seed)
    r.sync()
    r.log(f"random weights on {r.device} in {time.perf_counter() - t0:.1f} s")
    toks = Tokens(mcfg.vocab_size, a.zipf, a.seed)
    out: dict[str, Any] = {"prefill": bench_prefill(runner, a, toks, r), "decode": []}
    for b in a.decode_batches:
        out["decode"].append(bench_decode(runner, a, toks, r, b))
    if r.device.type == "cuda":
        out["max_memory_allocated_GiB"] = torch.cuda.max_memory_allocated(r.device) / 2**30
    del runner
    return out


def _step_imbalance(runner: ModelRunner, placement: Placement, r: Rank) -> np.ndarray:
    """Per-layer slowest rank / mean of this step's tokens received, by the engine's split rule."""
    load = r.sum_over_ranks(runner.expert_load().clone()).cpu().numpy()  # [L, E] all ranks' tokens
    return imbalance_matrix(rank_loads(load[None], placement))[0]  # [L]


def eplb_live(mcfg: ModelConfig, a: WorkerArgs, r: Rank, group: Any) -> dict[str, Any]:
    """Prefill steps with EPLB on: record -> decide -> move the weights while serving."""
    cfg = EplbConfig.for_pool(
        "prefill", num_redundant_per_rank=a.eplb_redundant, window_steps=a.eplb_window,
        period_steps=a.eplb_period, layers_per_step=a.layers,
    )  # fmt: skip
    n_layers, n_exp = a.layers, mcfg.n_routed_experts
    placements = [initial_placement(cfg, n_exp, r.world, r.rank)] * n_layers
    rcfg = RunnerConfig(
        num_blocks=a.prefill_seqs * _blocks(a.prefill_tokens // a.prefill_seqs), num_slots=a.prefill_seqs,
        dtype=a.dtype, device=str(r.device), with_mtp=False, ep_size=r.world, ep_rank=r.rank,
    )  # fmt: skip
    runner = ModelRunner.random(mcfg, rcfg, group, placements=placements, seed=a.seed)
    eplb = EngineEplb(cfg, runner.model.moe_layers(), r.rank, group)
    rmap, ranks = eplb.replica_map, eplb.runner
    toks = Tokens(mcfg.vocab_size, a.zipf, a.seed + 1)
    steps: list[dict[str, Any]] = []
    for step in range(a.eplb_steps):
        placement = Placement.from_phy2log(rmap.phy2log.cpu().numpy(), n_exp, r.world)
        batch = prefill_batch(a, toks, r, step, r.device)
        t = r.timed(runner.execute, batch)
        imb = _step_imbalance(runner, placement, r)
        moved = ranks.layers_moved
        remap_s = r.timed(eplb.after_step, step)  # record the loads, decide, move weights + routing
        moved = ranks.layers_moved - moved
        steps.append({"step": step, "step_ms": t * 1e3, "imbalance": float(imb.mean()), "layers_moved": moved,
                      "after_step_ms": remap_s * 1e3})  # fmt: skip
        r.log(f"eplb step {step}: {t * 1e3:.1f} ms, imbalance {imb.mean():.4f}, moved {moved} layers")
    return _eplb_summary(steps, ranks, r, cfg)


def _eplb_summary(
    steps: list[dict[str, Any]], eplb: EplbRankRunner, r: Rank, cfg: EplbConfig
) -> dict[str, Any]:
    # the forward of step s runs on the placement moved by after_step(s - 1)
    moves = [s["step"] for s in steps if s["layers_moved"]]
    first = moves[0] if moves else len(steps)
    nxt = moves[1] if len(moves) > 1 else len(steps)
    before = [s for s in steps if s["step"] <= first]
    after = [s for s in steps if first < s["step"] <= nxt]
    sent = r.sum_over_ranks(torch.tensor([eplb.bytes_sent, eplb.bytes_received], dtype=torch.float64,
                                         device=r.device)).tolist()  # fmt: skip

    def mean(rows: list[dict[str, Any]], key: str) -> float | None:
        return statistics.fmean(s[key] for s in rows) if rows else None

    return {
        "config": {
            "window_steps": cfg.window_steps,
            "period_steps": cfg.period_steps,
            "redundant_per_rank": cfg.num_redundant_per_rank,
            "algorithm": cfg.algorithm,
            "layers_per_step": cfg.layers_per_step,
        },  # fmt: skip
        "steps": steps,
        "imbalance_before": mean(before, "imbalance"),
        "imbalance_after": mean(after, "imbalance"),
        "step_ms_before": mean(before, "step_ms"),
        "step_ms_after": mean(after, "step_ms"),
        "remap_steps": moves,
        "remap_ms_each": [steps[i]["after_step_ms"] for i in moves],
        "decision_ms_each": [steps[i - 1]["after_step_ms"] for i in moves if i > 0],
        "remap_layers": sum(s["layers_moved"] for s in steps),
        "remap_bytes_sent_all_ranks": int(sent[0]),
        "remap_bytes_received_all_ranks": int(sent[1]),
    }


def worker(rank: int, world: int, rendezvous: str, args: dict[str, Any], out_dir: str) -> None:
    a = WorkerArgs(**{**args, "decode_batches": tuple(args["decode_batches"])})
    r = Rank(rank, world, a.device)
    group = None
    if a.device == "cuda":
        torch.cuda.set_device(r.device)
    else:
        torch.set_num_threads(1)
    if world > 1:
        backend = "nccl" if a.device == "cuda" else "gloo"
        join_group(backend, rendezvous, rank, world)
        dist.all_reduce(torch.zeros(1, device=r.device))  # p2p must not be the group's first collective
    try:
        mcfg = model_config(a)
        result = {"world": world, "throughput": throughput(mcfg, a, r, group)}
        if world > 1 and a.eplb_steps > 0:
            if r.device.type == "cuda":
                torch.cuda.empty_cache()
            result["eplb"] = eplb_live(mcfg, a, r, group)
        if rank == 0:
            Path(out_dir, f"ep{world}.json").write_text(json.dumps(result))
    finally:
        if world > 1:
            dist.destroy_process_group()
