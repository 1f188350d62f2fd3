"""`sluice bench engine --preset P`, prefill part: prefill tokens/s at real widths beside the
compute roofline and transformers' `DeepseekV4ForCausalLM`, and a long prompt's time and
peak memory.

The engine. A `ModelRunner` over seeded random weights built on the device (the preset's
widths, ``--layers`` decoder layers, no MTP layer). One step prefills one sequence of ``N``
tokens from position 0 in one chunk (``N`` from ``--prefill-tokens``); the median of
``--prefill-repeats`` synchronised steps after a warm-up is the step time; ``host_ms`` is the
median time until ``execute`` returns (the host's launches and any wait of its own): where it
nears the step time, the host, not the device, bounds the step. ``--host-profile`` adds, per
size, where one more step's host time went: ``cProfile`` over the step, the functions with the
most time of their own (`host_profile`).

The roofline. The numerator is `prefill_flops`: FLOPs counted from the model config, never
from what the implementation does (a dense mask, a padded tile or a recomputation counts for
nothing). Per token and layer, 2 FLOPs per multiply-add of:

* the attention projections: ``q_a`` (D x q_lora), ``q_b`` (q_lora x H*hd), ``kv`` (D x hd),
  the grouped ``o_a`` (H*hd x o_lora in all) and ``o_b`` (groups*o_lora x D);
* attention itself: QK and PV over the keys the token sees, 4*H*hd per key: its window
  (``min(p + 1, W)`` raw keys at position p) and its compressed entries (HCA: every complete
  entry, ``(p + 1) // 128``; CSA: ``min(index_topk, (p + 1) // 4)``);
* a compressor's kv and gate projections (D x 2hd each for CSA's overlapping pair, D x hd for
  HCA); a CSA layer's indexer: its compressor (D x 2dI, twice), ``q_b`` (q_lora x nI*dI), the
  head weights (D x nI) and its scoring, nI*dI per complete entry;
* the MoE: the gate (D x experts), ``num_experts_per_tok`` routed and ``n_shared_experts``
  shared SwiGLU experts (3 x D x moe_intermediate each);
* mHC: two hyper-connection mixes ((2 + n)*n x n*D each);
and once per sequence the ``lm_head`` on its last token (D x vocab). Norms, RoPE, softmax and
pooling are not counted. The denominator is a bf16 matmul rate measured in the same run (an
8192-cubed ``torch.mm``, median of 7), never below `MIN_CUDA_MATMUL_FLOPS` on CUDA.

transformers. The same config (eager attention), random weights of its own init, one forward
over the same number of tokens with its cache and ``logits_to_keep=1``, synchronised, median
after a warm-up. Its figure from 2026-12-01 on the H200 is `TF_REFERENCE_MS`; a run more than
15% away says so.

The A/B (``--pooling-kernel ab``). After the rest, `pooling_ab`: the compressors' pooling
kernel off then on, in ``--ab-rounds`` rounds on one runner, each size's step time per round.

The long prompt. One sequence of ``--long-context`` tokens prefilled in chunks of
``--long-chunk`` (the steps a scheduler would run), then 32 decode steps. The prompt is
prefilled twice: a first pass (``first_pass_s``: it compiles and tunes every kernel shape the
prompt's chunks use, ~3 s on the H200 that a served engine pays once) and the timed pass
(``prefill_s``, ``chunk_ms``: each chunk's time on the device's clock, CUDA events between the
chunks, so the host still issues ahead). Peak memory of the timed pass
(``torch.cuda.max_memory_allocated``) at each power-of-two multiple of 32,768 tokens and at
the end, beside the bound: the weights (bytes of every parameter and buffer) plus the cache
formula (`engine.cache.spec.CacheSpec`: the paged blocks of the context and one sequence's
slot) plus a 2 GiB workspace.
"""

from __future__ import annotations

import functools
import gc
import statistics
import time
from dataclasses import dataclass
from typing import Any

from services.bench import progress
from services.bench._engine_decode import _sync

#: never divide by a matmul rate below this on CUDA (804 TFLOP/s was measured on an H200)
MIN_CUDA_MATMUL_FLOPS = 750e12
#: transformers 5.24's 4,096-token prefill on one H200 (bf16, flash-shape, 2 layers, eager), 2026-12-01
TF_REFERENCE_MS = {4096: 83.9}
WORKSPACE_BOUND = 2 << 30


@dataclass(frozen=True)
class PrefillArgs:
    device: str
    dtype: str
    preset: str
    layers: int
    tokens: tuple[int, ...]
    repeats: int
    transformers: bool
    tf_tokens: int
    long_context: int
    long_chunk: int
    seed: int = 0
    fp8: bool = False  # the random weights quantised to FP8 and kept so (`ModelRunner.random`)
    fp8_compute: str = "w8a16"  # RunnerConfig.fp8_compute
    host_profile: bool = False  # one more step per size under cProfile (`host_profile`)
    ab_rounds: int = 0  # > 0: `pooling_ab`, the pooling kernel off and on interleaved, this many rounds


def prefill_flops(mc: Any, tokens: int) -> float:
    """FLOPs of prefilling one sequence of ``tokens`` tokens from position 0 (module docstring)."""
    from engine.config import CSA, HCA

    d, h, hd = mc.hidden_size, mc.num_attention_heads, mc.head_dim
    n = mc.hc_mult
    proj = d * mc.q_lora_rank + mc.q_lora_rank * h * hd + d * hd + h * hd * mc.o_lora_rank
    proj += mc.o_groups * mc.o_lora_rank * d
    moe = d * mc.n_routed_experts + 3 * d * mc.moe_intermediate_size * (
        mc.num_experts_per_tok + mc.n_shared_experts
    )
    hc = 2 * (2 + n) * n * n * d
    total = 0.0
    for kind in mc.layer_types:
        macs = tokens * (proj + moe + hc)
        keys = sum(min(p + 1, mc.sliding_window) for p in range(tokens))
        if kind == CSA:
            done = [(p + 1) // mc.csa_rate for p in range(tokens)]
            keys += sum(min(mc.index_topk, e) for e in done)
            di, ni = mc.index_head_dim, mc.index_n_heads
            macs += tokens * (2 * d * 2 * hd + 2 * d * 2 * di + mc.q_lora_rank * ni * di + d * ni)
            macs += sum(done) * ni * di
        elif kind == HCA:
            keys += sum((p + 1) // mc.hca_rate for p in range(tokens))
            macs += tokens * 2 * d * hd
        macs += 2 * h * hd * keys  # QK and PV
        total += 2 * macs
    return total + 2 * d * mc.vocab_size


def matmul_rate(device: str, dtype: str, repeats: int = 7) -> float:
    """FLOP/s of a square matmul at ``dtype`` (8192 on CUDA, 1024 on CPU), median of ``repeats``."""
    import torch

    n = 8192 if device.startswith("cuda") else 1024
    a = torch.randn(n, n, device=device, dtype=getattr(torch, dtype))
    b = torch.randn(n, n, device=device, dtype=getattr(torch, dtype))
    times = []
    for _ in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        times.append(time.perf_counter() - t0)
    del a, b
    return 2 * n**3 / statistics.median(times[1:])


def _runner(a: PrefillArgs, blocks: int):
    from engine.checkpoint.presets import preset_config
    from engine.config import ModelConfig
    from engine.runner import ModelRunner, RunnerConfig

    mc = ModelConfig.from_dict(preset_config(a.preset, num_hidden_layers=a.layers))
    cfg = RunnerConfig(
        num_blocks=blocks,
        num_slots=1,
        dtype=a.dtype,
        device=a.device,
        with_mtp=False,
        fp8_compute=a.fp8_compute,
    )
    return ModelRunner.random(mc, cfg, None, seed=a.seed, fp8=a.fp8)


def _ids(vocab: int, n: int, seed: int) -> list[int]:
    import torch

    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _batch(ids: list[int], start: int, table: list[int], device: str, sample: bool = True):
    import torch

    from engine.forward_batch import ForwardBatch, SequenceInput

    seq = SequenceInput(ids, start, 0, table, sample=sample)
    return ForwardBatch.from_sequences([seq], device=torch.device(device))


def _time_steps(runner: Any, a: PrefillArgs, n: int, table: list[int]) -> tuple[list[float], list[float]]:
    """``a.repeats`` one-chunk prefills of ``n`` tokens after a warm-up: (seconds until the
    step finished, seconds until ``execute`` returned: the host's launches and its own waits)."""
    times, hosts = [], []
    for r in range(a.repeats + 1):
        batch = _batch(_ids(runner.model_cfg.vocab_size, n, a.seed + r), 0, table, a.device)
        _sync(a.device)
        t0 = time.perf_counter()
        runner.execute(batch)
        hosts.append(time.perf_counter() - t0)
        _sync(a.device)
        times.append(time.perf_counter() - t0)
    return times[1:], hosts[1:]


def engine_prefill(a: PrefillArgs) -> list[dict[str, Any]]:
    """Step time of a one-chunk prefill of each of ``a.tokens`` (one runner, the largest's blocks)."""
    from engine.config import BLOCK_TOKENS

    blocks = -(-max(a.tokens) // BLOCK_TOKENS)
    runner = _runner(a, blocks)
    rows = []
    try:
        mc = runner.model_cfg
        table = list(range(blocks))
        for n in a.tokens:
            times, hosts = _time_steps(runner, a, n, table)
            ms = statistics.median(times) * 1e3
            rows.append({
                "tokens": n, "layers": mc.num_hidden_layers, "ms": ms, "tokens_per_s": n / ms * 1e3,
                "flops": prefill_flops(mc, n), "step_ms": [t * 1e3 for t in times],
                "host_ms": statistics.median(hosts) * 1e3,
            })  # fmt: skip
            if a.host_profile:
                batch = _batch(_ids(mc.vocab_size, n, a.seed), 0, table, a.device)
                rows[-1]["host_profile"] = host_profile(functools.partial(runner.execute, batch), a.device)
            progress(f"engine prefill: {n} tokens in {ms:.1f} ms ({n / ms * 1e3:,.0f} tok/s)")
    finally:
        del runner
        _free(a.device)
    return rows


def pooling_ab(a: PrefillArgs) -> list[dict[str, Any]]:
    """The compressors' pooling kernel off, then on, for ``a.ab_rounds`` rounds on one runner:
    each round times every size of ``a.tokens`` (median of ``a.repeats`` after a warm-up), so
    a host or clock that drifts during the run moves both variants alike. Restores the setting."""
    from engine.config import BLOCK_TOKENS
    from engine.kernels import pooling

    setting = pooling.FUSED_POOLING
    blocks = -(-max(a.tokens) // BLOCK_TOKENS)
    runner = _runner(a, blocks)
    rows: list[dict[str, Any]] = []
    try:
        table = list(range(blocks))
        for rnd in range(a.ab_rounds):
            for on in (False, True):
                pooling.FUSED_POOLING = on
                for n in a.tokens:
                    times, hosts = _time_steps(runner, a, n, table)
                    rows.append({
                        "round": rnd, "pooling_kernel": on, "tokens": n,
                        "ms": statistics.median(times) * 1e3, "host_ms": statistics.median(hosts) * 1e3,
                    })  # fmt: skip
                    progress(f"engine prefill A/B round {rnd + 1}/{a.ab_rounds}: pooling kernel "
                             f"{'on' if on else 'off'}, {n} tokens in {rows[-1]['ms']:.2f} ms")  # fmt: skip
    finally:
        pooling.FUSED_POOLING = setting
        del runner
        _free(a.device)
    return rows


def host_profile(step: Any, device: str, top: int = 15) -> dict[str, Any]:
    """Where one ``step()`` spends the host's time: ``cProfile`` over the step (its launches,
    up to the return), the ``top`` functions by time of their own, in ms. Profiling slows the
    host, so read the shares, not the total, against an unprofiled ``host_ms``."""
    import cProfile
    import pstats

    _sync(device)
    prof = cProfile.Profile()
    prof.enable()
    step()
    prof.disable()
    _sync(device)
    stats = pstats.Stats(prof).stats  # {(file, line, name): (calls, prim, tottime, cumtime, callers)}
    total = sum(v[2] for v in stats.values())
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return {
        "profiled_ms": total * 1e3,
        "functions": [
            {"function": f"{file.rsplit('/', 1)[-1]}:{line}({name})", "calls": v[0],
             "own_ms": round(v[2] * 1e3, 3), "cumulative_ms": round(v[3] * 1e3, 3)}
            for (file, line, name), v in rows
        ],
    }  # fmt: skip


def transformers_prefill(model_dir: Any, a: PrefillArgs) -> dict[str, Any]:
    import inspect

    import torch
    import transformers

    from services.bench._engine_decode import transformers_model

    model = transformers_model(model_dir, a.device, a.dtype, a.seed)
    config = model.config
    try:
        key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        ids = torch.tensor([_ids(config.vocab_size, a.tf_tokens, a.seed)], device=a.device)
        times = []
        with torch.inference_mode():
            for _ in range(a.repeats + 1):
                _sync(a.device)
                t0 = time.perf_counter()
                model(input_ids=ids, use_cache=True, logits_to_keep=1, **{key: None})
                _sync(a.device)
                times.append(time.perf_counter() - t0)
        ms = statistics.median(times[1:]) * 1e3
        ref = TF_REFERENCE_MS.get(a.tf_tokens) if a.device.startswith("cuda") else None
        out: dict[str, Any] = {
            "tokens": a.tf_tokens, "ms": ms, "tokens_per_s": a.tf_tokens / ms * 1e3,
            "transformers": transformers.__version__, "reference_ms": ref,
        }  # fmt: skip
        if ref is not None:
            out["versus_reference"] = ms / ref
            if abs(ms / ref - 1) > 0.15:
                out["why_not_reference"] = (
                    f"{ms:.1f} ms is {ms / ref - 1:+.0%} from the {ref} ms of 2026-12-01: another GPU "
                    f"clock, transformers {transformers.__version__} or torch {torch.__version__}"
                )
        progress(f"engine prefill: transformers {a.tf_tokens} tokens in {ms:.1f} ms")
        return out
    finally:
        del model
        _free(a.device)


def _model_bytes(model: Any) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def long_prefill(a: PrefillArgs) -> dict[str, Any]:
    """``a.long_context`` tokens in chunks of ``a.long_chunk``, a first pass then a timed one,
    then 32 decode steps: times and peak memory against weights + cache formula + workspace."""
    import torch

    from engine.cache.spec import CacheSpec
    from engine.config import BLOCK_TOKENS

    cuda = a.device.startswith("cuda")
    decode_steps = 32
    blocks = -(-(a.long_context + decode_steps) // BLOCK_TOKENS)
    runner = _runner(a, blocks)
    try:
        mc = runner.model_cfg
        weights = _model_bytes(runner.model)
        elem = runner.cfg.torch_dtype.itemsize
        spec = CacheSpec.from_model(mc, elem_bytes=elem, state_bytes=4)
        ids = _ids(mc.vocab_size, a.long_context + decode_steps, a.seed)
        table = list(range(blocks))
        chunks = [(s, min(a.long_context, s + a.long_chunk)) for s in range(0, a.long_context, a.long_chunk)]

        _sync(a.device)
        t0 = time.perf_counter()
        for s, e in chunks:
            runner.execute(_batch(ids[s:e], s, table, a.device, sample=e == a.long_context))
        _sync(a.device)
        first_pass_s = time.perf_counter() - t0
        progress(f"engine prefill: long prompt's first pass (compiles included) in {first_pass_s:.1f} s")
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            events = [torch.cuda.Event(enable_timing=True) for _ in range(len(chunks) + 1)]
        marks: list[dict[str, Any]] = []
        cpu_chunk_s: list[float] = []
        t0 = time.perf_counter()
        if cuda:
            events[0].record()
        for i, (s, e) in enumerate(chunks):
            t = time.perf_counter()
            runner.execute(_batch(ids[s:e], s, table, a.device, sample=e == a.long_context))
            if cuda:
                events[i + 1].record()
            else:
                cpu_chunk_s.append(time.perf_counter() - t)
            if e == a.long_context or (e % 32768 == 0 and (e // 32768) & (e // 32768 - 1) == 0):
                _sync(a.device)
                cache = spec.paged_bytes_per_block() * -(-e // BLOCK_TOKENS) + spec.slot_bytes()
                bound = weights + cache + WORKSPACE_BOUND
                peak = torch.cuda.max_memory_allocated() if cuda else None
                marks.append({
                    "tokens": e, "seconds": time.perf_counter() - t0, "peak_bytes": peak,
                    "weights_bytes": weights, "cache_formula_bytes": cache, "bound_bytes": bound,
                    "peak_over_bound": None if peak is None else peak / bound,
                })  # fmt: skip
                mem = (
                    ""
                    if peak is None
                    else f", peak {peak / 2**30:.2f} GiB of a {bound / 2**30:.2f} GiB bound"
                )
                progress(f"engine prefill: long prompt at {e} tokens after {marks[-1]['seconds']:.1f} s{mem}")
        prefill_s = time.perf_counter() - t0
        chunk_ms = (
            [events[i].elapsed_time(events[i + 1]) for i in range(len(chunks))]
            if cuda
            else [t * 1e3 for t in cpu_chunk_s]
        )
        times = []
        for i in range(decode_steps):
            p = a.long_context + i
            _sync(a.device)
            t = time.perf_counter()
            runner.execute(_batch(ids[p : p + 1], p, table, a.device))
            _sync(a.device)
            times.append(time.perf_counter() - t)
        return {
            "tokens": a.long_context, "chunk": a.long_chunk, "first_pass_s": first_pass_s,
            "prefill_s": prefill_s, "prefill_tokens_per_s": a.long_context / prefill_s,
            "chunk_ms": chunk_ms, "marks": marks, "decode_steps": decode_steps,
            "decode_ms_median": statistics.median(times) * 1e3,
            "peak_bytes_end": torch.cuda.max_memory_allocated() if cuda else None,
        }  # fmt: skip
    finally:
        del runner
        _free(a.device)


def _free(device: str) -> None:
    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def prefill_report(a: PrefillArgs, model_dir: Any) -> dict[str, Any]:
    """Everything above in one run; ``model_dir`` holds the config transformers builds from."""
    cuda = a.device.startswith("cuda")
    rate = matmul_rate(a.device, a.dtype)
    denom = max(rate, MIN_CUDA_MATMUL_FLOPS) if cuda else rate
    progress(f"engine prefill: matmul rate {rate / 1e12:.2f} TFLOP/s (roofline uses {denom / 1e12:.2f})")
    rows = engine_prefill(a)
    for r in rows:
        r["roofline_ms"] = r["flops"] / denom * 1e3
        r["fraction_of_roofline"] = r["roofline_ms"] / r["ms"]
    tf = None
    if a.transformers:
        try:
            tf = transformers_prefill(model_dir, a)
        except Exception as exc:  # noqa: BLE001 - reported, the engine's figures stand
            tf = {"tokens": a.tf_tokens, "error": f"{type(exc).__name__}: {exc}"}
    versus = None
    if tf is not None and "ms" in tf:
        ours = next((r for r in rows if r["tokens"] == a.tf_tokens), None)
        if ours is not None:
            versus = {"tokens": a.tf_tokens, "speedup": tf["ms"] / ours["ms"]}
    long = long_prefill(a) if a.long_context else None
    ab = pooling_ab(a) if a.ab_rounds else None
    return {
        "matmul_flops": rate, "roofline_flops": denom, "engine": rows, "transformers": tf,
        "versus_transformers": versus, "long_context": long, "pooling_ab": ab, "method": __doc__,
    }  # fmt: skip
