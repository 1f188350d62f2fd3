"""The ``simulator`` section of ``sluice bench e2e``: colocated vs disaggregated at DeepSeek's
scale in ``router.pd_sim``, with step times from a cost model fitted to GPU measurements.

**Decode fit data** (``DECODE_TABLES``): the engine's decode step tables measured on one
H200 (``router/data/decode_step_table_h200_flash{2,4}.json``: bf16, CUDA graphs, the
``flash-shape`` preset's widths with 2 and with 4 decoder layers, seeded random weights,
EP1, distinct tokens per sequence; ``python3 -m services.bench.router --profile-decode
--preset flash-shape --layers L --device cuda``): the median step over 9 batch sizes (1 to
256 sequences) x 5 KV totals (0 to 4M tokens).

**Prefill fit data** (``MEASURED``; it stands in until the GPU prefill profile lands): the
same GPU, widths and weights, 2 layers, one prefill step of 4,096 tokens (2 sequences of
2,048) on the eager path
(``python3 -m services.bench.ep --device cuda --preset flash-shape --layers 2 --ep 1``).

**Step model** (``step_model``):

* decode, ``c`` (fixed per step), ``d1`` (per decode sequence) and ``d2`` (per KV token a
  decode step holds): each cell of the tables extended to full depth by the measured cost of
  a layer, ``T_full = T_4 + (full - 4) * (T_4 - T_2) / 2`` (layers 3-4 are one CSA and one
  HCA layer, the mix of the full model's 22 CSA + 20 HCA), then least squares on relative
  error (``DecodeCostModel.fit``) over the cells whose sequences are at most 1M tokens deep (V4's
  context);
* ``b`` (per context token of a prefill piece): the model's paged cache bytes per token
  (``CacheSpec``, bf16) read once per step at the measured H200 copy bandwidth;
* ``a`` (per new-token x context-token pair of a prefill piece): the attention FLOPs that
  grow with context (CSA's lightning indexer over one row per 4 tokens, HCA's attention over
  one row per 128 tokens; the sliding window and CSA's top-k are bounded) at the measured
  bf16 matmul rate;
* ``d`` (per new prefill token): what is left of the 4,096-token prefill step once the
  2-layer decode table's fixed cost and the attention terms are taken off, multiplied by
  ``full layers / 2`` (43 / 2: all of it taken as per-layer work). ``a`` and ``b`` are
  computed from the 43-layer config itself. No MTP layer, no speculative decoding.

**EP.** An engine is one GPU: one data-parallel attention rank of a wide-EP group. Its step
time is the single-GPU fit for its own batch: with experts spread evenly a rank's MoE work
equals its own tokens' share (at EP2 the measured per-rank steps were 0.3 % slower at
prefill and 4-10 % at decode than EP1; at EP64 a rank reads 1/64 of the expert weights,
fewer than EP1's). Ranks step independently: the lockstep of a real EP group, where one
rank's prefill chunk holds up its group's decode step, is not modelled; that favours the
colocated configuration.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from services.bench import progress

REPO = Path(__file__).resolve().parents[2]
TRACES = REPO / "data" / "traces"

# The decode step tables of one H200 at 2 and 4 flash-shape layers (see the module docstring).
DECODE_TABLES = {layers: REPO / f"router/data/decode_step_table_h200_flash{layers}.json" for layers in (2, 4)}
DECODE_FIT_MAX_TOKENS_PER_SEQUENCE = 1_048_576  # DeepSeek-V4's context
# One H200, bf16, flash-shape widths, 2 layers, EP1: the prefill step (see the module docstring).
MEASURED: dict[str, Any] = {
    "layers": 2,
    "prefill_step": {"tokens": 4096, "sequences": 2, "seconds": 70.7e-3},
    "copy_bytes_per_s": 4260e9,  # measured device copy (docs/development.md, the GPU machine)
    "matmul_flops_per_s": 786e12,  # measured bf16 matmul
    "command": "python3 -m services.bench.ep --device cuda --preset flash-shape --layers 2 --ep 1",
}
FULL_LAYERS = 43  # DeepSeek-V4-Flash's decoder layers (its released config; MTP not counted)
HBM_BYTES = 141e9  # one H200
LINK_BYTES_PER_S = 400e9 / 8 / 8  # ~400 Gbit/s of prefill->decode interconnect per 8 GPUs
PREFIX_CACHE_BYTES = 64 * 2**30  # per engine, for its LRU prefix cache
MAX_BATCH = 256  # decode sequences per rank (DeepSeek's published decode operating point)
DISAGG_BUDGET = 32_768  # DeepSeek's prefill chunk budget
BUDGETS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
LOAD_GRID = tuple(2.0 ** (k / 2) for k in range(-8, 3))  # offered rate / nominal: 1/16 .. 2, steps of sqrt 2
TTFT_SLO_S = 2.0
TPOT_SLO_X = 1.5
LEVELS = (0.9, 0.8, 0.7, 0.5)
# colocated gets the better of the sluice router and plain least-load prefill routing (sluice's
# prefix affinity packs prefill and decode onto the engines holding a shared prefix)
COLOCATED_PREFILL_POLICIES = ("sluice", "least_load")  # shares of the feasible requests meeting both SLOs
TARGET = 1.5


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sim-requests", type=int, default=3000,
        help="simulate the first N requests of each trace (default 3000)",
    )  # fmt: skip
    p.add_argument(
        "--sim-traces", default="conversation_trace,synthetic_trace",
        help="trace names under data/traces (the first is the headline)",
    )  # fmt: skip
    p.add_argument(
        "--sim-budgets", default=",".join(map(str, BUDGETS)),
        help="colocated chunk budgets to sweep (prefill tokens per step)",
    )  # fmt: skip


# ------------------------------------------------------------------ the step model
def _layer_model(layers: int) -> Any:
    from engine.checkpoint.presets import preset_config
    from engine.config import ModelConfig

    return ModelConfig.from_dict(preset_config("flash-shape", num_hidden_layers=layers))


def pair_flops(cfg: Any) -> float:
    """Attention FLOPs per (new token, context token) pair that grow with context, all layers:
    CSA's indexer scores one row per ``rate`` tokens (index heads x index dim, multiply-add),
    HCA attends one row per ``rate`` tokens (scores and values over every head)."""
    from engine.config import CSA, HCA

    total = 0.0
    for layer, kind in enumerate(cfg.layer_types):
        if kind == CSA:
            total += 2.0 * cfg.index_n_heads * cfg.index_head_dim / cfg.rate(layer)
        elif kind == HCA:
            total += 4.0 * cfg.num_attention_heads * cfg.head_dim / cfg.rate(layer)
    return total


def cache_bytes(cfg: Any) -> tuple[float, float]:
    """(paged bytes per token summed over the layers, one sequence's window slot), bf16."""
    from engine.cache.spec import CacheSpec

    spec = CacheSpec.from_model(cfg, elem_bytes=2, state_bytes=2)
    return float(sum(spec.paged_bytes_per_token(t) for t in spec.layer_types)), float(spec.slot_bytes())


def decode_full_depth(
    tables: dict[int, Path] = DECODE_TABLES, full_layers: int = FULL_LAYERS
) -> tuple[Any, Any, Any]:
    """(the 2-layer table, its fit, the fit of every cell extended to ``full_layers``: see
    the module docstring)."""
    from router.steptable import StepTable

    t2, t4 = StepTable.load(tables[2]), StepTable.load(tables[4])
    if t2.batch != t4.batch or t2.kv_tokens != t4.kv_tokens:
        raise ValueError("the 2- and 4-layer decode tables must share their grid")
    per_layer = (t4.seconds - t2.seconds) / 2
    full = StepTable(t2.batch, t2.kv_tokens, np.maximum(t4.seconds + (full_layers - 4) * per_layer, 1e-6))
    cap = DECODE_FIT_MAX_TOKENS_PER_SEQUENCE
    return t2, t2.fit(cap), full.fit(cap)


def step_model(
    measured: dict[str, Any] = MEASURED,
    full_layers: int = FULL_LAYERS,
    tables: dict[int, Path] = DECODE_TABLES,
) -> tuple[Any, dict[str, Any]]:
    """The full-depth ``StepModel`` and how it was derived (for the report)."""
    from router.pd_sim import StepModel

    lm, full = _layer_model(measured["layers"]), _layer_model(full_layers)
    per_tok_f, slot_f = cache_bytes(full)
    bw, flops = measured["copy_bytes_per_s"], measured["matmul_flops_per_s"]
    a_m = pair_flops(lm) / flops
    t2, dec_m, dec_f = decode_full_depth(tables, full_layers)
    pf = measured["prefill_step"]
    chunk = pf["tokens"] // pf["sequences"]
    var = pf["seconds"] - dec_m.d0 - pf["sequences"] * (a_m * chunk * chunk + dec_m.d2 * chunk)
    d_m = max(var / pf["tokens"], 0.0)
    k = full_layers / measured["layers"]
    model = StepModel(
        c=dec_f.d0, d=d_m * k, a=pair_flops(full) / flops, b=per_tok_f / bw, d1=dec_f.d1, d2=dec_f.d2
    )
    meta = t2.meta
    info = {
        "fit_data": {
            "decode_tables": {str(n): str(p.relative_to(REPO)) for n, p in tables.items()},
            "decode_gpu": meta.get("gpu"), "decode_date": meta.get("date"), "decode_command": meta.get("command"),
            "prefill": measured,
        },
        "fit_data_status": "decode: the engine's step tables measured on the GPU (CUDA graphs); prefill: a "
        "stand-in eager measurement until the GPU prefill profile lands",
        "measured_layers": {"c_s": dec_m.d0, "d_s_per_token": d_m, "d1_s_per_seq": dec_m.d1, "a_s_per_pair": a_m,
                            "d2_s_per_kv_token": dec_m.d2},
        "full_layers": full_layers,
        "depth_scale": k,
        "depth_rule": f"decode: T_full = T_4 + ({full_layers} - 4) * (T_4 - T_2) / 2 per table cell, fitted; "
        f"d x {full_layers}/{measured['layers']}; a, b from the full-depth config's attention FLOPs and cache bytes",
        "step_model": {"c_s": model.c, "d_s_per_token": model.d, "a_s_per_pair": model.a,
                       "b_s_per_context_token": model.b, "d1_s_per_seq": model.d1, "d2_s_per_kv_token": model.d2},
        "formula": "t = c + d*sum(C) + a*sum(C*(C+H)) + b*sum(C+H) + d1*B + d2*K",
        "full_depth_examples_s": {
            "decode_B1": model.decode_step(1, 0), "decode_B256_ctx8k": model.decode_step(256, 256 * 8192),
            "prefill_4096": model.step_time([(4096, 0)], 0, 0.0),
            "prefill_32768": model.step_time([(32768, 0)], 0, 0.0),
        },
        "cache_bytes_per_token_bf16": per_tok_f,
        "window_slot_bytes_bf16": slot_f,
        "ep_assumptions": "engine = one GPU = one DP-attention rank of a wide-EP group; step time = the "
        "single-GPU fit for the rank's own batch; ranks step independently (no EP lockstep: favours colocated)",
    }  # fmt: skip
    return model, info


# ------------------------------------------------------------------ one system
def _policies(
    mode: str, n_pre: int, n_dec: int, step: Any, budget: int, prefill: str = "sluice"
) -> tuple[Any, Any, Any]:
    from router import sluice
    from router.policy import PREFILL_POLICIES, PolicyContext
    from router.prefix_index import PrefixIndex, PrefixIndexConfig

    cost, dcost = step.cost_model(budget), step.decode_cost_model()
    index = PrefixIndex(PrefixIndexConfig(n_pre))
    pre = PREFILL_POLICIES.create(prefill, PolicyContext(n_pre, index=index, cost=cost, decode_cost=dcost))
    dec = None
    if mode == "disaggregated":
        dec = sluice.TwoDimDecode(PolicyContext(n_dec, cost=cost, decode_cost=dcost))
    return pre, dec, index


def _policy_configs(step: Any) -> dict[str, str]:
    pre, dec, _ = _policies("disaggregated", 2, 2, step, DISAGG_BUDGET)
    return {
        "prefill": f"{type(pre).__name__}({pre.config!r})",
        "decode": f"{type(dec).__name__}({dec.config!r})",
    }


def _config(mode: str, step: Any, budget: int, cache_blocks: int, per_tok: float, slot: float) -> Any:
    from router.pd_sim import PDConfig

    return PDConfig(
        mode=mode, step=step, num_prefill=64, num_decode=64, num_colocated=128, prefill_budget=budget,
        max_batch=MAX_BATCH, cache_blocks=cache_blocks, handoff_bytes_per_token=per_tok,
        handoff_fixed_bytes=slot, link_bytes_per_s=LINK_BYTES_PER_S,
    )  # fmt: skip


def _run_at(trace: Any, cfg: Any, prefill: str = "sluice") -> Any:
    from router.pd_sim import PDSimulator

    def run_at(time_scale: float) -> Any:
        n_pre = cfg.num_colocated if cfg.mode == "colocated" else cfg.num_prefill
        pre, dec, index = _policies(cfg.mode, n_pre, cfg.num_decode, cfg.step, cfg.prefill_budget, prefill)
        return PDSimulator(trace, cfg, pre, dec, index=index, time_scale=time_scale).run()

    return run_at


def _points(sw: Any) -> list[dict[str, Any]]:
    return [
        {"rate_req_s": p.rate, "attainment": p.attainment, "attainment_feasible": p.attainment_feasible,
         "slo_met_req_s": p.slo_met_req_s, "ttft_p50_s": p.ttft_p50_s, "ttft_p99_s": p.ttft_p99_s,
         "tpot_p50_s": p.tpot_p50_s, "tpot_p99_s": p.tpot_p99_s, "hit_rate": p.hit_rate, "engine_steps": p.steps}
        for p in sw.points
    ]  # fmt: skip


def _summary(sw: Any) -> dict[str, Any]:
    return {
        "goodput_req_s": {f"{lv:g}": sw.goodput(lv) for lv in LEVELS},
        "goodput_rate_req_s": {f"{lv:g}": sw.goodput_rate(lv) for lv in LEVELS},
        "points": _points(sw),
    }


def headline_level(dis: Any, colo: Sequence[Any]) -> float | None:
    """The strictest of ``LEVELS`` that the disaggregated system and at least one colocated
    budget reach at the lowest swept rate (None: none)."""

    def reaches(sw: Any, lv: float) -> bool:
        return bool(sw.points) and sw.points[0].attainment_feasible >= lv

    for lv in LEVELS:
        if reaches(dis, lv) and any(reaches(sw, lv) for sw in colo):
            return lv
    return None


def nominal_rate(trace: Any, step: Any, engines: int, budget: int) -> float:
    """Requests per second ``engines`` prefill engines would sustain with no cache hits and
    one request per step (chunks of ``budget``): the scale of the rate grid."""
    cost = step.cost_model(budget)
    mean_s = float(np.mean([cost.prefill_time(int(n)) for n in trace.input_len]))
    return engines / mean_s


def run_trace(
    name: str, n_requests: int, budgets: Sequence[int], step: Any, info: dict[str, Any]
) -> dict[str, Any]:
    from router.pd_sim import SLO, feasible, rate_of, sweep
    from router.trace import load_trace

    trace = load_trace(TRACES / f"{name}.jsonl", limit=n_requests)
    per_tok, slot = info["cache_bytes_per_token_bf16"], info["window_slot_bytes_bf16"]
    cache_blocks = max(1, int(PREFIX_CACHE_BYTES // (per_tok * trace.block_size)))
    unloaded = step.decode_step(1, 0)
    slo = SLO(TTFT_SLO_S, TPOT_SLO_X * unloaded)
    ok = feasible(trace, step.cost_model(DISAGG_BUDGET), slo, unloaded)
    lam = nominal_rate(trace, step, 64, DISAGG_BUDGET)
    rates = [lam * x for x in LOAD_GRID]
    out: dict[str, Any] = {
        "trace": name, "requests": len(trace), "native_rate_req_s": rate_of(trace, 1.0),
        "mean_input_tokens": float(trace.input_len.mean()), "mean_output_tokens": float(trace.output_len.mean()),
        "feasible_share": float(ok.mean()), "nominal_rate_req_s": lam, "rate_grid_req_s": rates,
        "prefix_cache_blocks_per_engine": cache_blocks,
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "unloaded_decode_step_s": unloaded},
    }  # fmt: skip
    progress(f"sim {name}: {len(trace)} requests, {ok.mean():.3f} feasible, nominal rate {lam:.2f} req/s")
    t0 = time.perf_counter()

    def run(mode: str, budget: int, label: str, prefill: str = "sluice") -> Any:
        cfg = _config(mode, step, budget, cache_blocks, per_tok, slot)
        return sweep(trace, rates, _run_at(trace, cfg, prefill), slo, ok, progress, f"sim {name} {label}")

    dis = run("disaggregated", DISAGG_BUDGET, "disaggregated 64+64")
    colo = {
        (pol, b): run("colocated", b, f"colocated 128 {pol} budget {b}", pol)
        for pol in COLOCATED_PREFILL_POLICIES
        for b in budgets
    }
    level = headline_level(dis, list(colo.values()))
    lv = 0.0 if level is None else level
    best = max(colo, key=lambda k: (colo[k].goodput(lv), -k[1]))
    g_d, g_c = dis.goodput(lv), colo[best].goodput(lv)
    out["headline_level"] = level
    out["disaggregated"] = {"prefill_budget": DISAGG_BUDGET, "prefill_policy": "sluice", **_summary(dis)}
    out["colocated"] = {
        "best_prefill_policy": best[0], "best_budget": best[1], "goodput_req_s": g_c,
        "goodput_rate_req_s": colo[best].goodput_rate(lv),
        "by_policy_and_budget": {
            pol: {str(b): _summary(sw) for (p, b), sw in colo.items() if p == pol} for pol in COLOCATED_PREFILL_POLICIES
        },
    }  # fmt: skip

    def ratio(x: float) -> float | None:
        top = max(sw.goodput(x) for sw in colo.values())
        return dis.goodput(x) / top if top > 0 else None

    out["headline"] = {
        "level": level, "disaggregated_goodput_req_s": g_d, "colocated_goodput_req_s": g_c,
        "colocated_best_prefill_policy": best[0], "colocated_best_budget": best[1],
        "goodput_ratio": g_d / g_c if g_c > 0 else math.inf,
        "ratio_by_level": {f"{x:g}": ratio(x) for x in LEVELS},
    }  # fmt: skip
    out["goodput_ratio"] = out["headline"]["goodput_ratio"]
    out["sim_wall_s"] = time.perf_counter() - t0
    progress(
        f"sim {name}: level {level}: goodput disaggregated {g_d:.2f} vs colocated {g_c:.2f} req/s "
        f"({best[0]}, budget {best[1]}): ratio {out['goodput_ratio']:.2f}"
    )
    return out


def run_simulator(args: argparse.Namespace) -> dict[str, Any]:
    step, info = step_model()
    progress(
        f"sim: full-depth step model: decode B=1 {step.decode_step(1, 0) * 1e3:.0f} ms, prefill 4096 "
        f"{info['full_depth_examples_s']['prefill_4096'] * 1e3:.0f} ms"
    )
    budgets = [int(x) for x in str(args.sim_budgets).split(",") if x.strip()]
    names = [x.strip() for x in str(args.sim_traces).split(",") if x.strip()]
    out: dict[str, Any] = {
        "model": info,
        "systems": {
            "disaggregated": f"64 prefill engines (chunk budget {DISAGG_BUDGET}, sluice prefill routing) + 64 "
            f"decode engines (<= {MAX_BATCH} sequences per step, TwoDimDecode), handoff = cache bytes / "
            f"{LINK_BYTES_PER_S / 1e9:.2f} GB/s per transfer",
            "colocated": f"128 engines, each step = the whole decode batch (<= {MAX_BATCH}) + up to budget new "
            f"prefill tokens (prefill routing: the better of {', '.join(COLOCATED_PREFILL_POLICIES)}; decode stays "
            "on the engine)",
        },
        "goodput_definition": f"SLO: TTFT <= {TTFT_SLO_S:g} s and TPOT <= {TPOT_SLO_X:g} x the unloaded decode "
        "step (one sequence). Feasible requests: those whose prefill on an idle engine, with every hit an "
        "infinite shared cache would give, fits the TTFT (the rest miss it at any load, in both systems). "
        "Goodput rate at level L: the offered rate at which the share of feasible requests meeting both "
        "SLOs falls to L (first crossing going up the rate grid, interpolated in log rate); goodput: "
        "requests per second meeting both SLOs at that rate (rate x share of all requests meeting both). "
        f"Levels {list(LEVELS)}; the headline level is the strictest one that the disaggregated system and "
        "at least one colocated budget reach at the lowest swept rate",
        "rate_sweep": "arrival times of the first N trace requests scaled to offered rates nominal x "
        "1/16 .. 2 in steps of sqrt(2); nominal = 64 / mean unloaded prefill seconds (no cache hits)",
        "prefix_cache": f"LRU per engine, {PREFIX_CACHE_BYTES / 2**30:.0f} GiB of bf16 cache blocks",
        "policies": _policy_configs(step),
        "traces": {},
    }  # fmt: skip
    for name in names:
        out["traces"][name] = run_trace(name, args.sim_requests, budgets, step, info)
    return out
