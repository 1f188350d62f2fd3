"""`sluice bench engine --preset P`: decode tokens/s through the engine at real widths, beside
the memory-bandwidth roofline and transformers' `DeepseekV4ForCausalLM` on the same config.

The engine. A weightless model directory of preset ``P`` (`write_config_dir`, with
``--layers`` decoder layers) served by an `EngineCore` over seeded random weights built on the
device (``EngineConfig.random_weights``), prefix caching off, the engine's default loop.
For each batch ``B`` it admits ``B`` requests of ``context`` random token ids (``ignore_eos``;
greedy, or with ``--sampling drawn`` / ``penalised`` drawn with or without penalties,
`request_params`), steps until every request has its first token, then times ``steps`` whole
engine steps (scheduling, the forward pass, sampling, output handling): ms per step and
tokens/s = tokens emitted / wall time.

The roofline (bytes per decode step over the copy bandwidth). The numerator comes from the
model, not from the implementation: every weight of the decoder layers that is not a routed
expert; of the routed experts, those the step's routing selected, each counted once (the MoE
layers' load counters of a timed step); the embedding rows of the batch's tokens; the whole
``lm_head``; the final norm and hc head; and the KV each sequence reads per layer: its window
(``min(context, sliding_window)`` rows of ``head_dim``), an HCA layer's compressed entries
(``context / hca_rate`` rows), a CSA layer's indexer keys (``context / csa_rate`` rows of
``index_head_dim``) and its ``index_topk`` selected entries. Bytes are at the serving dtype
(parameters transformers keeps in fp32 counted at fp32). The denominator is a device-to-device
copy of 1 GiB (0.25 GiB on CPU) timed here, read + write bytes over the median time; on CUDA
never below ``MIN_CUDA_COPY_BPS`` (4.0 TB/s; 4.26 TB/s was measured on an H200). Per layer:
the layers' share of the bytes, and, with two or more ``--layers``, step time = fixed +
layers x per-layer fitted over the depths.

transformers. The same config (eager attention), random weights of its own init, the same
device and dtype, batch ``B``: one forward over a ``tf_context``-token prompt with its cache,
then ``steps`` single-token forwards with that cache and a device argmax, each synchronised and
timed. Its eager prefill materialises ``[B, heads, T, T + entries]`` attention scores, so its
context is ``--tf-context`` (default 128, the context of the 2026-12-01 reference figures);
the engine is timed at that context too, for the like-for-like ratio. On CUDA one more step
runs under the CUDA profiler: the time its kernels keep the GPU busy (``device_busy_ms``)
says whether the step is bound by the device or by the host issuing its kernels, and
``speedup_vs_its_device_time`` is the engine against that busy time alone (transformers on an
infinitely fast host). Where its step is more than 15 % away from the 2026-12-01 reference
(``TF_REFERENCE_MS``), ``reference_check.why`` says which, with the host's cost of one bare
kernel launch (``host_launch_us``) measured in the same run.

Rounds (``--decode-rounds R``, default 3 on the CPU, 1 on CUDA). Where a machine's speed
drifts during the run (a shared 2-core VM), an engine figure and a transformers figure timed
minutes apart compare two machines. Rounds 2..R time, per batch, the engine and then
transformers back to back; ``speedup`` is the median over the rounds of each round's ratio
(round 1: the figures above), ``rounds`` keeps every pair.
"""

from __future__ import annotations

import functools
import gc
import inspect
import itertools
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.bench import progress

MIN_CUDA_COPY_BPS = 4.0e12
#: transformers 5.24's step times on one H200 (bf16, flash-shape widths, 2 layers, eager), 2026-12-01
TF_REFERENCE_MS = {1: 15.4, 64: 18.6}


@dataclass(frozen=True)
class DecodeArgs:
    device: str
    dtype: str
    preset: str
    layers: tuple[int, ...]
    batches: tuple[int, ...]
    context: int
    tf_context: int
    steps: int
    transformers: bool
    seed: int = 0
    decode_graphs: str = "auto"  # EngineConfig.decode_graphs
    async_scheduling: bool | None = None  # EngineConfig.async_scheduling (None: auto)
    pipeline_steps: bool | None = None  # EngineConfig.pipeline_steps (None: auto)
    batch_invariant: bool = False  # EngineConfig.batch_invariant
    fp8: bool = False  # EngineConfig.keep_quantized: the random weights quantised to FP8 and kept so
    fp8_compute: str = "w8a16"  # EngineConfig.fp8_compute
    sampling: str = "greedy"  # the requests' sampling: greedy, drawn or penalised (`request_params`)
    rounds: int = 1  # > 1: more rounds of engine then transformers per batch, the ratio's median


def request_params(sampling: str, i: int, max_tokens: int) -> Any:
    """Request ``i``'s sampling params for the decode report's ``sampling`` kind."""
    from engine.sampling.params import SamplingParams

    if sampling == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    drawn = {"temperature": 0.8, "top_p": 0.95, "seed": i, "max_tokens": max_tokens, "ignore_eos": True}
    if sampling == "drawn":
        return SamplingParams(**drawn)
    if sampling == "penalised":
        return SamplingParams(**drawn, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3)
    raise ValueError(f"unknown sampling {sampling!r}: greedy, drawn or penalised")


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str, repeats: int = 7) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), median of ``repeats``."""
    import torch

    n = (1 << 30) if device.startswith("cuda") else (1 << 28)
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * n / statistics.median(times[1:])


def _param_bytes(model: Any, batch: int) -> tuple[float, float, list[tuple[Any, float]]]:
    """(layer bytes without routed experts, fixed bytes, [(moe, bytes per expert)]). Weights
    kept quantised count as stored: the FP8 (or FP4) tensor and its scales (buffers)."""
    layers = fixed = 0.0
    moes: list[tuple[Any, float]] = []
    quantised = ((n, b) for n, b in model.named_buffers() if n.endswith(("qweight", "scale", "_q", "_s")))
    for name, p in itertools.chain(model.named_parameters(), quantised):
        size = p.numel() * p.element_size()
        if name.startswith("mtp.") or ".experts." in name:
            continue
        if name.startswith("model.embed"):
            fixed += batch * p.shape[-1] * p.element_size()  # the batch's rows
        elif name.startswith("model.layers."):
            layers += size
        else:
            fixed += size  # lm_head, final norm, hc head
    for layer in model.model.layers:
        moe = layer.mlp
        ex = moe.experts
        parts = [getattr(ex, f"{w}_{x}") for w in sorted(ex.quantized) for x in "qs"]
        parts += [getattr(ex, w) for w in ("gate_up_proj", "down_proj") if w not in ex.quantized]
        per = sum(t.numel() * t.element_size() for t in parts) / ex.num_local
        moes.append((moe, per))
    return layers, fixed, moes


def kv_bytes(mc: Any, context: int, batch: int, elem: int) -> float:
    """KV bytes one decode step reads, from the config (see the module docstring)."""
    from engine.config import CSA, HCA

    per_seq = 0.0
    for kind in mc.layer_types:
        per_seq += min(context, mc.sliding_window) * mc.head_dim
        if kind == HCA:
            per_seq += (context // mc.hca_rate) * mc.head_dim
        elif kind == CSA:
            per_seq += (context // mc.csa_rate) * mc.index_head_dim
            per_seq += min(mc.index_topk, context // mc.csa_rate) * mc.head_dim
    return per_seq * batch * elem


def engine_decode(model_dir: Path, a: DecodeArgs, batch: int, context: int) -> dict[str, Any]:
    import torch

    from engine.core import EngineCore
    from engine.engine_config import EngineConfig
    from engine.messages import CoreRequest

    budget = max(context, 16_384 if a.device.startswith("cuda") else 4096)
    # requests admitted first decode while the others prefill: none may finish, or the timed
    # batch would shrink, so each may emit one token per prefill step besides the timed ones
    max_tokens = a.steps + 16 + -(-batch * context // budget)
    per_seq = -(-(context + max_tokens + 8) // 256)
    cfg = EngineConfig(
        model=str(model_dir), random_weights=a.seed, device=a.device, dtype=a.dtype,
        num_blocks=batch * per_seq + 4, num_swa_slots=batch, max_num_seqs=batch,
        max_num_batched_tokens=budget,
        enable_prefix_caching=False, decode_graphs=a.decode_graphs, async_scheduling=a.async_scheduling,
        pipeline_steps=a.pipeline_steps,
        batch_invariant=a.batch_invariant, keep_quantized=a.fp8, fp8_compute=a.fp8_compute,
    )  # fmt: skip
    core = EngineCore(cfg)
    try:
        gen = torch.Generator().manual_seed(a.seed + batch)
        vocab = core.vocab_size
        for i in range(batch):
            ids = torch.randint(3, vocab, (context,), generator=gen).tolist()
            core.add(CoreRequest(f"d{i}", tuple(ids), request_params(a.sampling, i, max_tokens)))
        started: set[str] = set()
        t0 = time.perf_counter()
        while len(started) < batch:  # prefill (untimed)
            started.update(o.request_id for o in core.step() if o.new_token_ids)
        prefill_s = time.perf_counter() - t0
        for _ in range(2):  # the first decode steps (allocation, the asynchronous pipeline)
            core.step()
        runner = core.runner
        graphs = runner.graphs
        captured = graphs.captures if graphs else 0
        emitted = 0
        times = []
        _sync(a.device)
        t_all = time.perf_counter()
        for _ in range(a.steps):
            t = time.perf_counter()
            emitted += sum(len(o.new_token_ids) for o in core.step())
            times.append(time.perf_counter() - t)
        _sync(a.device)
        wall = time.perf_counter() - t_all
        mc = runner.model_cfg
        layer_w, fixed_w, moes = _param_bytes(runner.model, batch)
        hit = sum(int((moe.last_load > 0).sum()) * per for moe, per in moes)
        elem = runner.cfg.torch_dtype.itemsize
        kv = kv_bytes(mc, context + a.steps, batch, elem)
        return {
            "batch": batch, "context": context, "layers": mc.num_hidden_layers, "steps": a.steps,
            "ms_per_step": wall / a.steps * 1e3, "ms_per_step_median": statistics.median(times) * 1e3,
            "tokens_per_s": emitted / wall, "emitted": emitted, "prefill_s": prefill_s,
            "decode_graphs": a.decode_graphs, "async_scheduling": core.config.overlaps_steps, "pipelined": core.config.pipelines_steps,
            "fed_tokens": core.executor.fed_tokens, "graph_replays": graphs.replays if graphs else 0,
            "batch_invariant": a.batch_invariant, "sampling": a.sampling,
            "graph_captures": graphs.captures if graphs else 0,
            "graph_captures_timed": (graphs.captures if graphs else 0) - captured,
            "bytes": {"layer_weights": layer_w, "experts_selected": hit, "fixed": fixed_w, "kv": kv,
                      "total": layer_w + hit + fixed_w + kv, "layers_share": (layer_w + hit + kv) / (layer_w + hit + fixed_w + kv)},
        }  # fmt: skip
    finally:
        core.close()
        del core
        gc.collect()
        if a.device.startswith("cuda"):
            torch.cuda.empty_cache()
        if a.batch_invariant:  # process-wide: transformers' run must have torch's kernels
            from engine.kernels import batch_invariant

            batch_invariant.disable()


def transformers_model(model_dir: Path, device: str, dtype: str, seed: int) -> Any:
    """transformers' `DeepseekV4ForCausalLM` at ``model_dir``'s config, eager attention,
    random weights of its own init (seeded), built on ``device`` at ``dtype``."""
    import torch
    from transformers import AutoConfig, DeepseekV4ForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device(device):
            return DeepseekV4ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)


def transformers_decode(model_dir: Path, a: DecodeArgs, batch: int) -> dict[str, Any]:
    import torch
    import transformers

    model = transformers_model(model_dir, a.device, a.dtype, a.seed)
    config = model.config
    try:
        gen = torch.Generator().manual_seed(a.seed + batch)
        ids = torch.randint(3, config.vocab_size, (batch, a.tf_context), generator=gen).to(a.device)
        times = []
        # the cache argument is `cache` from transformers 5.24 on, `past_key_values` before
        key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        with torch.inference_mode():
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            cache = getattr(out, key)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(a.steps + 2):
                _sync(a.device)
                t = time.perf_counter()
                out = model(input_ids=nxt, use_cache=True, logits_to_keep=1, **{key: cache})
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                _sync(a.device)
                times.append(time.perf_counter() - t)
            ms = statistics.median(times[2:]) * 1e3
            row = {
                "batch": batch, "context": a.tf_context, "ms_per_step": ms, "tokens_per_s": batch / ms * 1e3,
                "transformers": transformers.__version__,
            }  # fmt: skip
            if a.device.startswith("cuda"):
                step = functools.partial(
                    model, input_ids=nxt, use_cache=True, logits_to_keep=1, **{key: cache}
                )
                busy_ms, kernels = device_busy(step)
                row |= {"device_busy_ms": busy_ms, "kernels_per_step": kernels}
        return row
    finally:
        del model
        gc.collect()
        if a.device.startswith("cuda"):
            torch.cuda.empty_cache()


def device_busy(step: Any) -> tuple[float, int]:
    """(ms the GPU spends in kernels and copies, how many it runs) in one call of ``step``,
    by the CUDA profiler: beside the call's wall time it says whether the call is bound by
    the device or by the host that issues its kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    return sum(e.self_device_time_total for e in events) / 1e3, sum(e.count for e in events)


def launch_cost_us(device: str, n: int = 2000) -> float:
    """Microseconds the host takes to issue one tiny kernel (``n`` in a row, then one sync):
    what an eager, launch-bound step pays per kernel on this host."""
    import torch

    x = torch.zeros(1, device=device)
    for _ in range(100):
        x.add_(1)
    _sync(device)
    t = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    _sync(device)
    return (time.perf_counter() - t) / n * 1e6


def reference_check(row: dict[str, Any], reference_ms: float, launch_us: float | None) -> dict[str, Any]:
    """transformers' step against ``reference_ms`` (the 2026-12-01 figure): within 15 %, or why
    not, from what this run measured (its kernels' busy time, the host's launch cost)."""
    ratio = row["ms_per_step"] / reference_ms
    out: dict[str, Any] = {
        "reference_ms": reference_ms,
        "ratio": ratio,
        "within_15_percent": abs(ratio - 1) <= 0.15,
    }
    if out["within_15_percent"] or "device_busy_ms" not in row:
        return out
    wall, busy, kernels = row["ms_per_step"], row["device_busy_ms"], row["kernels_per_step"]
    host = max(wall - busy, 0.0)
    launch = f"; a bare launch costs {launch_us:.1f} us on this host" if launch_us else ""
    if busy < 0.5 * wall:
        out["why"] = (
            f"host-bound: its {kernels} kernels keep the GPU busy {busy:.2f} ms of its {wall:.2f} ms step; "
            f"the other {host:.2f} ms ({host / max(kernels, 1) * 1e3:.1f} us a kernel) are the host running "
            f"Python and issuing them{launch}. The step follows the host CPU, which differs between the "
            f"machines lent as one kind; the GPU's share ({busy:.2f} ms) is what carries over"
        )
    else:
        out["why"] = (
            f"device-bound: its {kernels} kernels keep the GPU busy {busy:.2f} ms of its {wall:.2f} ms step, "
            f"so this GPU ran them at {ratio:.2f}x the reference's time (the reference recorded no split)"
        )
    return out


def _fit_per_layer(rows: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Per batch: step ms = fixed + layers x per_layer, least squares over the depths run."""
    out: dict[int, dict[str, float]] = {}
    for b in sorted({r["batch"] for r in rows}):
        pts = [(r["layers"], r["ms_per_step"]) for r in rows if r["batch"] == b]
        if len({x for x, _ in pts}) < 2:
            continue
        mx = statistics.fmean(x for x, _ in pts)
        my = statistics.fmean(y for _, y in pts)
        slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        out[b] = {"per_layer_ms": slope, "fixed_ms": my - slope * mx}
    return out


def decode_report(a: DecodeArgs, workdir: Path) -> dict[str, Any]:
    from engine.checkpoint.generate import write_config_dir

    bw = copy_bandwidth(a.device)
    floor = MIN_CUDA_COPY_BPS if a.device.startswith("cuda") else 0.0
    denom = max(bw, floor)
    progress(f"engine decode: copy bandwidth {bw / 1e9:.0f} GB/s (roofline uses {denom / 1e9:.0f})")
    rows: list[dict[str, Any]] = []
    like: list[dict[str, Any]] = []
    tf: list[dict[str, Any]] = []
    pairs: list[dict[str, Any]] = []  # rounds 2.. (`DecodeArgs.rounds`)
    for layers in a.layers:
        model_dir = write_config_dir(
            a.preset, workdir / f"{a.preset}-{layers}", seed=a.seed, num_hidden_layers=layers
        )
        for b in a.batches:
            r = engine_decode(model_dir, a, b, a.context)
            r["roofline_ms"] = r["bytes"]["total"] / denom * 1e3
            r["fraction_of_roofline"] = r["roofline_ms"] / r["ms_per_step"]
            rows.append(r)
            progress(
                f"engine decode: {layers} layers, batch {b}, context {a.context}: {r['ms_per_step']:.2f} ms/step, "
                f"{r['tokens_per_s']:.0f} tok/s, {r['fraction_of_roofline']:.1%} of the roofline"
            )
            if a.tf_context != a.context:
                s = engine_decode(model_dir, a, b, a.tf_context)
                like.append(s)
        if a.transformers and layers == a.layers[0]:
            for b in a.batches:
                try:
                    t = transformers_decode(model_dir, a, b)
                except Exception as exc:  # noqa: BLE001 - reported, the engine's figures stand
                    t = {"batch": b, "error": f"{type(exc).__name__}: {exc}"}
                tf.append(t)
                progress(
                    f"engine decode: transformers batch {b}: {t.get('ms_per_step', float('nan')):.2f} ms/step"
                )
            for rnd in range(1, a.rounds):
                for b in a.batches:
                    ours = engine_decode(model_dir, a, b, a.tf_context)
                    t = transformers_decode(model_dir, a, b)
                    pairs.append({"round": rnd, "batch": b, "sluice_ms": ours["ms_per_step"],
                                  "transformers_ms": t["ms_per_step"]})  # fmt: skip
                    progress(
                        f"engine decode: round {rnd + 1}/{a.rounds}, batch {b}: sluice "
                        f"{ours['ms_per_step']:.2f} ms/step, transformers {t['ms_per_step']:.2f}"
                    )
    cuda = a.device.startswith("cuda")
    launch_us = launch_cost_us(a.device) if tf and cuda else None
    same_ctx = like or rows
    versus = []
    for t in tf:
        if "error" in t:
            continue
        ours = next(r for r in same_ctx if r["batch"] == t["batch"] and r["layers"] == a.layers[0])
        ref = TF_REFERENCE_MS.get(t["batch"])
        rounds = [
            {
                "round": 0,
                "batch": t["batch"],
                "sluice_ms": ours["ms_per_step"],
                "transformers_ms": t["ms_per_step"],
            }
        ]
        rounds += [p for p in pairs if p["batch"] == t["batch"]]
        versus.append({
            "batch": t["batch"], "context": t["context"], "sluice_ms": ours["ms_per_step"],
            "transformers_ms": t["ms_per_step"],
            "speedup": statistics.median(p["transformers_ms"] / p["sluice_ms"] for p in rounds),
            "rounds": rounds, "transformers_vs_reference": (t["ms_per_step"] / ref) if ref and cuda else None,
        })  # fmt: skip
        if "device_busy_ms" in t:  # against a transformers whose host cost nothing: a floor
            versus[-1]["speedup_vs_its_device_time"] = t["device_busy_ms"] / ours["ms_per_step"]
        if ref and cuda:
            check = versus[-1]["reference_check"] = reference_check(t, ref, launch_us)
            verdict = "within 15 %" if check["within_15_percent"] else check.get("why", "outside 15 %")
            progress(
                f"engine decode: transformers batch {t['batch']}: {check['ratio']:.2f}x the reference; {verdict}"
            )
    return {
        "copy_bandwidth_Bps": bw,
        "roofline_bandwidth_Bps": denom,
        "engine": rows,
        "engine_at_tf_context": like,
        "transformers": tf,
        "host_launch_us": launch_us,
        "versus_transformers": versus,
        "per_layer_fit": {str(k): v for k, v in _fit_per_layer(rows).items()},
        "method": __doc__,
    }
