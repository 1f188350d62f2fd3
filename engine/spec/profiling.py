"""Measure a `SpecProfile`: the wall time of whole engine steps (schedule, verification
forward, sampling, drafting, update) with ``B`` requests each verifying ``k`` drafts; for
each ``B`` also a plain decode step (no speculation), a step drafting one token (the cost
of one chained drafting pass is the difference to drafting ``drafted``, per pass) and a step
in which one request verifies one draft (``first_verified``: the verification path's own
cost, which a selection of a few drafts pays).
Each cell keeps the smallest of ``rounds`` medians: on a shared machine, interference only
ever adds time. The rounds are interleaved (`measure_spec_profiles`): every cell is measured
once before any is measured again.

For every batch size ``B`` and draft count ``k = 0 .. drafted`` an `EngineCore` runs the
``fixed-k:drafted`` policy (the MTP layer drafts ``drafted`` tokens per request, ``k`` are
verified) over ``B`` requests of up to ``prompt_tokens`` tokens (staggered by ``k`` mod the
model's compression period, as the bench's runs are), decoding greedily without
stopping. After ``warmup`` steps of the decode phase, a step counts when every one of the
``B`` requests verified exactly ``k`` drafts; the profile keeps the median of ``steps`` such
steps. With CUDA graphs, a step that captured one (of any kind: a shape's once in an engine's
life) neither counts as warm-up nor is timed, as in `sluice bench spec`'s runs. Prefix
caching is off so that no request starts from another's state.

The prompts are text (``heldout_prompts``: windows of the held-out split, through the
checkpoint's tokenizer), falling back to seeded random tokens when the text cannot be had.
Acceptance changes a step's cost, not only how fast contexts grow: the MTP layer's first
pass runs over the input token and every accepted draft, so a request that accepted 3
drafts gives it 4 rows where a rejected one gives 1. On random tokens almost nothing is
accepted, and the trained preset's verification steps measured up to 1.8x what such a
profile priced them at (docs/benchmarks.md, "Speculative decoding").
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine.spec.profile import MAX_DRAFTS, SpecProfile, spec_steps_file


def device_steps_file(device: str) -> str:
    """The step profile's file name for ``device`` (`spec_steps_file`: a GPU's is named after
    its model)."""
    if not device.startswith("cuda"):
        return spec_steps_file()
    import torch

    return spec_steps_file(torch.cuda.get_device_name(torch.device(device)))


def _cell(
    model: Path, batch: int, k: int, drafted: int, prompts: Sequence[Sequence[int]], warmup: int, steps: int,
    engine_kwargs: dict[str, Any], verifying: int | None = None,
) -> float:  # fmt: skip
    """Median seconds of a step verifying ``k`` drafts per request and drafting ``drafted``;
    ``drafted = 0``: plain decoding (no speculation); ``verifying``: only that many requests
    verify (the first), the others none."""
    from engine.core import EngineCore
    from engine.engine_config import EngineConfig
    from engine.messages import CoreRequest
    from engine.sampling.params import SamplingParams

    prompt_tokens = max(len(p) for p in prompts)
    per_req = prompt_tokens + (warmup + steps + 4) * (k + 1)
    blocks = batch * (-(-per_req // 256) + 1) + 4
    cfg = EngineConfig(
        model=str(model), speculative=f"fixed-{k}:{drafted}" if drafted else None, max_num_seqs=batch,
        num_swa_slots=batch,
        num_blocks=blocks, max_num_batched_tokens=max(32_768, batch * prompt_tokens),
        enable_prefix_caching=False, async_scheduling=False, **engine_kwargs,
    )  # fmt: skip
    core = EngineCore(cfg)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=per_req - prompt_tokens, ignore_eos=True)
        for i in range(batch):
            core.add(CoreRequest(f"p{i}", tuple(prompts[i % len(prompts)]), params))
        spec = core.spec
        if spec is not None:
            spec.verifying_requests = verifying
        wanted = (1, (batch if verifying is None else verifying) * k)
        times: list[float] = []
        seen = 0
        for i in range(warmup + 4 * steps + 8):
            before = (spec.stats.steps, spec.stats.verified) if spec is not None else (0, 0)
            captures = graph_captures(core)
            t0 = time.perf_counter()
            core.step()
            dt = time.perf_counter() - t0
            after = (spec.stats.steps, spec.stats.verified) if spec is not None else (1, 0)
            if i == 0 or (after[0] - before[0], after[1] - before[1]) != wanted:
                continue  # the prefill step, or not every verifying request verified k drafts
            if core.stats().running != batch:
                break
            if graph_captures(core) != captures:
                continue  # it captured a CUDA graph (of any kind): once in an engine's life
            seen += 1
            if seen > warmup:
                times.append(dt)
            if len(times) >= steps:
                break
        if not times:
            raise RuntimeError(
                f"batch {batch}, {k} drafts: no step verified {k} drafts of every verifying request"
            )
        return statistics.median(times)
    finally:
        core.close()


def graph_captures(core: Any) -> int:
    """CUDA graphs the engine ``core`` has captured so far, of every kind (0 without graphs)."""
    graphs = core.runner.graphs
    return graphs.captures if graphs is not None and graphs.capture else 0


def release_memory(engine_kwargs: dict[str, Any]) -> None:
    """Free a closed engine's memory before the next cell builds one: its weights, caches and
    CUDA graphs sit in reference cycles, freed by the cycle collector at a random later point;
    at DeepSeek-V4-Flash's widths two engines' weights do not fit one GPU (an H200 ran out of
    memory 30 cells into a profile), and frees inside another engine's timed steps stretch
    them (on the H200 a DSpark engine with speculation off stepped at 5.5-7.2 ms after the
    fixed-K engines at 128 requests, and at 3.66 ms alone in a fresh process)."""
    import gc

    gc.collect()
    if str(engine_kwargs.get("device", "cpu")).startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def measure_spec_profile(
    model: str | Path, batches: Sequence[int] = (1, 8, 16, 32, 64, 128), **kwargs: Any
) -> SpecProfile:
    """The step profile of the checkpoint at ``model`` (the module doc says what each cell is;
    ``kwargs``: `measure_spec_profiles`'s settings and the engine's)."""
    key = Path(model)
    return measure_spec_profiles({key: key}, batches, **kwargs)[key]


def measure_spec_profiles(
    models: dict[Any, Path],
    batches: Sequence[int] = (1, 8, 16, 32, 64, 128),
    drafted: int = MAX_DRAFTS,
    prompt_tokens: int = 256,
    warmup: int = 4,
    steps: int = 8,
    rounds: int = 2,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    say: Callable[[Any, str], None] | None = None,
    **engine_kwargs: Any,
) -> dict[Any, SpecProfile]:
    """`measure_spec_profile` of each checkpoint in ``models`` (key -> directory), with the
    rounds interleaved: round ``r`` measures every cell of every model once before round
    ``r + 1`` starts. A machine that drifts over a lease (clocks, a neighbour's load) then
    slows every cell's round alike, and the fastest round of each cell is kept, instead of
    slowing a run of neighbouring cells, or one model's whole table, that were measured
    back to back: the slope between two depths and the step between two draft counts are
    differences of cells, which such drift moves. Each cell's every round is kept in
    ``meta["round_ms"]`` (``"b<batch> <what>"`` -> ms per round), to show the spread."""
    t_start = time.perf_counter()
    prompts = {key: _prompts(Path(m), max(batches), prompt_tokens, seed) for key, m in models.items()}
    cells = _cells(batches, drafted)
    times: dict[Any, dict[tuple[int, int, int, int | None], list[float]]] = {key: {} for key in models}
    for r in range(rounds):
        for key, model in models.items():
            for b, k, d, verifying in cells:
                t = _cell(Path(model), b, k, d, prompts[key][0], warmup, steps, engine_kwargs, verifying)
                release_memory(engine_kwargs)  # here: inside `_cell` its frame still holds the engine
                times[key].setdefault((b, k, d, verifying), []).append(t)
                message = f"spec profile: round {r + 1}/{rounds}, batch {b}, {_what(k, d, verifying)}: {t * 1e3:.1f} ms/step"
                if say is not None:
                    say(key, message)
                elif progress is not None:
                    progress(message)
    wall = round(time.perf_counter() - t_start, 1)
    out = {}
    for key in models:
        fastest = {cell: min(ts) for cell, ts in times[key].items()}
        seconds, draft_pass, plain, first = [], [], [], []
        for b in batches:
            row = [fastest[b, k, drafted, None] for k in range(drafted + 1)]
            seconds.append(tuple(row))
            # the verification path's own cost: one request verifies one draft (at 1 request
            # that is k = 1's cell)
            one = fastest.get((b, 1, drafted, 1))
            first.append(one if one is not None else row[min(1, drafted)])
            plain.append(fastest[b, 0, 0, None])
            # one chained pass: what drafting one token instead of ``drafted`` saves, per pass
            draft_pass.append(max(row[0] - fastest[b, 0, 1, None], 0.0) / max(drafted - 1, 1))
        meta = {
            "method": "median wall time of engine steps (engine.spec.profiling)",
            "prompt_tokens": prompt_tokens,
            "prompts": prompts[key][1],
            "steps": steps,
            "warmup": warmup,
            "rounds": rounds,
            "interleaved": len(models) > 1 or rounds > 1,
            "wall_s": wall,
            "round_ms": {
                f"b{b} {_what(k, d, v)}": [round(t * 1e3, 3) for t in ts]
                for (b, k, d, v), ts in times[key].items()
            },
            **{k: str(v) for k, v in engine_kwargs.items()},
        }
        out[key] = SpecProfile(
            tuple(batches), tuple(range(drafted + 1)), tuple(seconds), drafted, tuple(draft_pass),
            tuple(plain), meta, tuple(first),
        )  # fmt: skip
    return out


def _cells(batches: Sequence[int], drafted: int) -> list[tuple[int, int, int, int | None]]:
    """A profile's cells as ``(batch, k verified, drafted, verifying requests)``, in the order
    measured: per batch the step verifying none; the step in which one request verifies one
    draft (measured next to it, which it is compared with; at 1 request that is k = 1's cell);
    k = 1 .. drafted; plain decoding; drafting one token."""
    out: list[tuple[int, int, int, int | None]] = []
    for b in batches:
        out.append((b, 0, drafted, None))
        if b > 1 and drafted:
            out.append((b, 1, drafted, 1))
        out += [(b, k, drafted, None) for k in range(1, drafted + 1)]
        out += [(b, 0, 0, None), (b, 0, 1, None)]
    return out


def _what(k: int, drafted: int, verifying: int | None) -> str:
    if verifying is not None:
        return f"{k} draft of one request verified, {drafted} drafted"
    return f"{k} of {drafted} drafts verified" if drafted else "plain decoding"


def _prompts(model: Path, n: int, length: int, seed: int) -> tuple[list[list[int]], str]:
    """``n`` prompts of at most ``length`` ids: held-out text, else seeded random tokens; and
    which. Staggered (`engine.prompts.staggered`): prompt k is k mod the model's
    compression period shorter, so that plain steps are not priced in a lockstep that
    speculating steps leave."""
    from engine.prompts import phase_period, staggered, text_or_random_prompts

    prompts, source = text_or_random_prompts(model, n, length, seed)
    period = phase_period(model)
    return staggered(prompts, period), f"{source}, {length} - (k mod {period}) ids"


def measure_width_profiles(
    preset: str,
    depths: Sequence[int],
    work_dir: str | Path,
    batches: Sequence[int] = (1, 8, 16, 32, 64, 128),
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    ep: int = 1,
    **kwargs: Any,
) -> dict[int, SpecProfile]:
    """`measure_spec_profile` of a generated preset's widths (flash-shape: DeepSeek-V4-Flash's)
    at each decoder depth in ``depths``, with its MTP layer and seeded random weights built on
    the device (``EngineConfig.random_weights``; no checkpoint is written). Random weights
    accept almost no drafts, so the MTP layer's first pass runs over one row per request (a
    trained model's runs over 1 + its accepted drafts); the verification forward, which DSpark
    trades against, is priced exactly. `engine.spec.profile.extrapolate_layers` takes two of
    them to the model's real depth. The depths' rounds are interleaved (`measure_spec_profiles`).

    ``ep`` > 1: the compute of one rank of an expert-parallel instance of ``ep`` ranks
    (`rank_experts`): the rank's share of the routed experts, every layer's (the MTP layer's
    too), receiving its own tokens' rows, as a balanced exchange gives it; the exchange itself
    is not timed."""
    rank = {}
    if ep > 1:
        rank = {"ep": ep, "experts_per_rank": rank_experts(preset, ep), "exchange": "not timed"}
    models = {
        depth: rank_model_dir(preset, ep, depth, Path(work_dir) / f"{preset}-{depth}l", seed)
        for depth in depths
    }
    where = "" if ep == 1 else f" (one EP {ep} rank's compute)"

    def say(depth: int, msg: str) -> None:
        if progress is not None:
            progress(f"{preset} x {depth} layers{where}: {msg}")

    measured = measure_spec_profiles(models, batches, seed=seed, say=say, random_weights=seed, **kwargs)
    return {
        depth: replace(
            p, meta={**p.meta, "preset": preset, "layers": depth, "weights": f"random, seed {seed}", **rank}
        )
        for depth, p in measured.items()
    }


def rank_model_dir(preset: str, ep: int, layers: int, out: Path, seed: int = 0) -> Path:
    """A model directory (config, no weights: `EngineConfig(random_weights=seed)` builds them
    on the device) of ``preset``'s widths and ``layers`` decoder layers, holding one EP ``ep``
    rank's share of the routed experts (`rank_experts`; ``ep = 1``: all of them)."""
    from engine.checkpoint.generate import write_config_dir

    experts = {} if ep == 1 else {"n_routed_experts": rank_experts(preset, ep)}
    return write_config_dir(preset, out, seed, num_hidden_layers=layers, **experts)


def rank_experts(preset: str, ep: int) -> int:
    """The routed experts one rank of an EP ``ep`` instance of ``preset`` holds, as a model of
    that many experts that times the rank's compute on one device: a balanced exchange brings
    a rank as many rows as its own tokens send out (``tokens x top-k``), spread over its
    ``E / ep`` experts, which is what a model of ``E / ep`` experts routing the same tokens
    computes. Its top-k must still name distinct experts, so ``E / ep >= top-k`` (flash-shape:
    256 experts, top-6, so EP 32 at most: 8 a rank; at EP 64 a rank's rows are the same and
    its experts' weights half as many)."""
    from engine.checkpoint.presets import PRESETS

    cfg = PRESETS[preset]
    experts, top_k = int(cfg["n_routed_experts"]), int(cfg["num_experts_per_tok"])
    if ep < 1 or experts % ep:
        raise ValueError(f"EP {ep} does not divide {preset}'s {experts} routed experts")
    if experts // ep < top_k:
        most = max(n for n in range(1, experts + 1) if experts % n == 0 and experts // n >= top_k)
        raise ValueError(
            f"one rank of EP {ep} holds {experts // ep} of {preset}'s {experts} experts, fewer than the "
            f"{top_k} each token is routed to, so one device cannot stand for it; EP {most} at most"
        )
    return experts // ep
