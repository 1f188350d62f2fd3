"""`sluice bench spec`'s single run (`run_policy`, imported there as ``_run``): one
`EngineCore` (`_engine_config`), one speculation policy, prompts decoded greedily at most
``concurrency`` at a time. An untimed warm-up round first (`_warm_up`), then the timed round's
decode steps recorded one by one (`_timed_round` into a `StepRecord`) and turned, with the
policy's counters, into the run's figures (`_results`; `services.bench.spec`'s module doc says
what each measures).

* ``window_rate``: tokens per second over the steps a set of masks picks.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.bench._spec_replay import window_per_sequence

if TYPE_CHECKING:
    from engine.core import EngineCore
    from engine.cuda_graphs import DecodeGraphs
    from engine.engine_config import EngineConfig

#: most warm-up rounds with CUDA graphs (each on the same engine; the last captured nothing new)
WARMUP_ROUNDS = 3


def run_policy(
    model: Path,
    prompts: list[list[int]],
    tokens: int,
    policy: str,
    profile_path: Path | None,
    engine_kwargs: dict[str, Any],
    warmup_tokens: int = 0,
    concurrency: int | None = None,
    measured_costs: bool = True,
    finish_spread: int = 1,
    decisions: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One engine, one policy: ``prompts`` decoded ``tokens`` each (prompt ``k``: ``tokens``
    minus ``k mod finish_spread``), at most ``concurrency`` (default: all of them) at a
    time; a finished request's slot goes to the next prompt. ``decisions``: where a DSpark
    policy records its `view` after each step with drafts, warm-up included
    (`SpecPolicy.decisions`; scripts/spec_decisions.py)."""
    from engine.core import EngineCore

    c = concurrency or len(prompts)
    if c > len(prompts):
        raise ValueError(f"concurrency {c} exceeds the {len(prompts)} prompts")
    if not 1 <= finish_spread <= tokens:
        raise ValueError(f"finish_spread must be within 1..{tokens} (the tokens a request generates)")
    cfg = _engine_config(model, prompts, tokens, policy, profile_path, engine_kwargs, c, measured_costs)
    core = EngineCore(cfg)
    if core.spec is not None:
        core.spec.decisions = decisions
    try:
        graphs = core.runner.graphs if core.runner.graphs is not None and core.runner.graphs.capture else None
        if graphs is not None:  # the timed round's shapes, captured before it
            warmup_tokens = max(warmup_tokens, tokens)
        warmup_rounds = _warm_up(core, prompts[:c], warmup_tokens, graphs)
        if core.spec is not None:
            core.spec.trace = []
        steps = _timed_round(core, prompts, tokens, c, finish_spread, graphs)
        return _results(core, cfg, policy, c, len(prompts), steps, warmup_rounds)
    finally:
        core.close()


def _engine_config(
    model: Path,
    prompts: list[list[int]],
    tokens: int,
    policy: str,
    profile_path: Path | None,
    engine_kwargs: dict[str, Any],
    c: int,
    measured_costs: bool,
) -> EngineConfig:
    """The run's engine: ``c`` slots, room for every request's prompt and ``tokens``, prefix
    caching off, speculating by ``policy`` (``none``: no speculation)."""
    from engine.engine_config import EngineConfig

    per_req = len(prompts[0]) + tokens
    return EngineConfig(
        model=str(model), max_num_seqs=c, num_swa_slots=c, num_blocks=c * (-(-per_req // 256) + 1) + 4,
        max_num_batched_tokens=max(32_768, c * len(prompts[0])), enable_prefix_caching=False,
        speculative=None if policy == "none" else policy,
        spec_profile_path=str(profile_path) if profile_path is not None else None,
        spec_measured_costs=measured_costs, **engine_kwargs,
    )  # fmt: skip


def _warm_up(
    core: EngineCore, prompts: list[list[int]], warmup_tokens: int, graphs: DecodeGraphs | None
) -> int:
    """The untimed warm-up on ``core``: ``prompts`` (their first 64 tokens; with CUDA graphs,
    the whole prompts) generating ``warmup_tokens`` each, then the policy's counters reset so
    that they count the timed round only. Returns the rounds run (0 without warm-up tokens)."""
    from engine.messages import CoreRequest
    from engine.sampling.params import SamplingParams

    warmup_rounds = 0
    if warmup_tokens:
        warm = SamplingParams(temperature=0.0, max_tokens=warmup_tokens, ignore_eos=True)
        # with graphs, rounds until one captures nothing new: a policy that changes its
        # mind in a round (DSpark turning speculation off once its evidence is in) reaches
        # shapes the round before never ran, and their captures belong to the warm-up
        for rnd in range(WARMUP_ROUNDS if graphs is not None else 1):
            warmup_rounds = rnd + 1
            before = graphs.captures if graphs is not None else 0
            for i, p in enumerate(prompts):
                core.add(CoreRequest(f"w{rnd}-{i}", tuple(p if graphs is not None else p[:64]), warm))
            while core.has_work():
                core.step()
            if graphs is None or graphs.captures == before:
                break
        if core.spec is not None:
            core.spec.stats = type(core.spec.stats)()  # count the timed round only
    return warmup_rounds


@dataclass
class StepRecord:
    """The timed round's decode steps, an entry per step in each list (the first step, every
    prefill and the first tokens, is not one)."""

    # wall seconds of the step (its `EngineCore.step`)
    step_times: list[float] = field(default_factory=list)
    # decode tokens (a prompt's first token is its prefill's)
    step_tokens: list[int] = field(default_factory=list)
    # requests that decoded in the step
    decoders: list[int] = field(default_factory=list)
    # a step of all ``c`` requests (before the first has finished)
    full: list[bool] = field(default_factory=list)
    # a step while prompts still wait for a slot: the batch refilled
    steady: list[bool] = field(default_factory=list)
    # per step: it captured a CUDA graph (a shape's once in a serving engine's life: a
    # probe reaching a context bucket the warm-up never verified at, say), so the figures,
    # which are the steady state's, leave it out and count it apart
    captured: list[bool] = field(default_factory=list)
    # per decode step: prompt tokens computed in it (refills' prefills, run inside the
    # decode steps here, where a disaggregated deployment's prefill pool would run them)
    prompts_in: list[int] = field(default_factory=list)
    # per decode step: ms, tokens, drafted, verified, accepted, depth, captured, prompt
    # tokens (--step-log)
    log: list[list[float | int]] = field(default_factory=list)
    # CUDA graphs captured during the round; None: no graphs
    graph_captures: int | None = None

    def record(
        self,
        seconds: float,
        tokens: int,
        decoders: int,
        full: bool,
        steady: bool,
        captured: bool,
        prompt_tokens: int,
        spec_delta: list[int],
        depth: int,
    ) -> None:
        """One decode step: its wall time, the decode tokens it emitted, the requests that
        decoded, its window flags, the prompt tokens it computed, and its speculation counters
        (drafted, verified, accepted) with the drafting depth for the next step."""
        self.captured.append(captured)
        self.prompts_in.append(prompt_tokens)
        self.step_times.append(seconds)
        self.step_tokens.append(tokens)
        self.decoders.append(decoders)
        self.full.append(full)
        self.steady.append(steady)
        self.log.append([round(seconds * 1e3, 3), tokens, *spec_delta, depth, int(captured), prompt_tokens])


def _timed_round(
    core: EngineCore,
    prompts: list[list[int]],
    tokens: int,
    c: int,
    finish_spread: int,
    graphs: DecodeGraphs | None,
) -> StepRecord:
    """Every prompt added (request ``k`` generating ``tokens - k mod finish_spread``; the engine
    runs ``c`` at a time), then the engine stepped until done, each step after the first
    timed and recorded."""
    from engine.messages import CoreRequest
    from engine.sampling.params import SamplingParams

    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=tokens - i % finish_spread, ignore_eos=True)
        core.add(CoreRequest(f"r{i}", tuple(p), params))
    steps = StepRecord()
    started: set[str] = set()
    first = True
    captures_before = graphs.captures if graphs is not None else 0
    spec = core.spec
    while core.has_work():
        waiting = len(started) < len(prompts)
        step_captures = graphs.captures if graphs is not None else 0
        counts = _spec_counts(spec)
        prompt_before = core.loop.prompt_tokens
        t0 = time.perf_counter()
        outs = core.step()
        dt = time.perf_counter() - t0
        decoded = [o for o in outs if o.new_token_ids and o.request_id in started]
        started.update(o.request_id for o in outs if o.new_token_ids)
        if first:  # the prefill step: the first c prompts and their first tokens
            first = False
            continue
        steps.record(
            seconds=dt,
            tokens=sum(len(o.new_token_ids) for o in decoded),
            decoders=len(decoded),
            full=len(decoded) == c and len(started) == c,
            steady=waiting,
            captured=graphs is not None and graphs.captures != step_captures,
            prompt_tokens=core.loop.prompt_tokens - prompt_before,
            spec_delta=[a - b for a, b in zip(_spec_counts(spec), counts)],
            depth=spec.depth if spec is not None else 0,
        )
    steps.graph_captures = graphs.captures - captures_before if graphs is not None else None
    return steps


def _results(
    core: EngineCore,
    cfg: EngineConfig,
    policy: str,
    c: int,
    requests: int,
    steps: StepRecord,
    warmup_rounds: int,
) -> dict[str, Any]:
    """The run's figures from its recorded steps and the policy's counters; the keys with a
    leading underscore are the per-step lists the bench prices and drops
    (`services.bench.spec`'s ``_price`` and ``_drop_private``)."""
    step_times, step_tokens, full, steady = steps.step_times, steps.step_tokens, steps.full, steps.steady
    captured, prompts_in = steps.captured, steps.prompts_in
    timed = [not cap for cap in captured]
    decode_only = [p == 0 for p in prompts_in]
    seconds = sum(t for t, k in zip(step_times, timed) if k)
    stats = core.spec.stats if core.spec is not None else None
    trace = core.spec.trace if core.spec is not None else None
    req_steps = sum(len(s) for s in trace) if trace else 0
    steady_verified, steady_length = (
        window_per_sequence(trace, steps.decoders, steady) if trace else (0.0, 1.0)
    )
    extra = core.stats().extra
    costs = "spec_cost_scale_plain" in extra  # DSpark rescaled its profile (measured costs)
    return {
        "policy": policy,
        "concurrency": c,
        "decode_steps": len(step_times),
        "decode_seconds": seconds,
        "tokens_per_s": window_rate(step_tokens, step_times, timed),
        "emitted": sum(step_tokens),
        # the steps in which all c requests decode (before the first finishes): the run
        # at concurrency c, without its drain
        "full_batch_steps": sum(full),
        "full_batch_tokens_per_s": window_rate(step_tokens, step_times, full, timed),
        # with more prompts than slots: the steps while prompts still wait, each slot
        # refilled as its request finishes (decoding at concurrency c, prompts mixed in)
        "requests": requests,
        "steady_steps": sum(steady),
        "steady_tokens_per_s": window_rate(step_tokens, step_times, steady, timed),
        # of those steps, the ones that also computed refills' prompts, and their share of
        # the steps' time: where the refills come in one wave (plain decoding's requests of
        # one length) or spread over several steps (after any speculation)
        "steady_prompt_steps": sum(1 for k, p, t in zip(steady, prompts_in, timed) if k and p and t),
        "steady_prompt_time_share": _share(step_times, [p > 0 for p in prompts_in], steady, timed),
        # and over the steady steps without prompts: what a decode pool fed by a prefill
        # pool runs (its sequences arrive with their caches)
        "steady_decode_tokens_per_s": window_rate(step_tokens, step_times, steady, timed, decode_only),
        # drafts verified per decode step of the batch (the issue's "verified tokens per
        # step"), and per sequence per step: a batch step's count moves with how many
        # sequences the step decodes, so the c >= 32 target compares the per-sequence one
        # (DeepSeek's "5.00 -> 3.2-4.4" is per sequence), over the same request-steps as
        # the accepted length
        "verified_per_step": stats.verified / stats.steps if stats and stats.steps else 0.0,
        "verified_per_sequence": stats.verified / req_steps if stats and req_steps else 0.0,
        "accepted_length": 1.0 + (stats.accepted / req_steps) if stats and req_steps else 1.0,
        # the same two over the steady steps, the window the steady throughput is judged on
        # (the drain after the last refill decodes at smaller, dearer batches)
        "steady_verified_per_sequence": steady_verified,
        "steady_accepted_length": steady_length,
        "policies_chosen": dict(stats.policies) if stats else {"none": len(step_times)},
        # steps that drafted while speculation was off: each costs its share of the probe
        # budget, and a short run that holds one pays more than that share
        "probes": stats.probes if stats else 0,
        "step_ms_median": statistics.median(step_times) * 1e3 if step_times else 0.0,
        # host time of the policy's per-step choice (SpecPolicy.choose), per decode step
        "choose_ms_per_step": stats.choose_seconds / len(step_times) * 1e3 if stats and step_times else 0.0,
        # asynchronous (--scheduling async): a step that neither drafts nor verifies
        # overlaps the next one's scheduling, speculating or not
        "async_scheduling": cfg.overlaps_steps,
        # CUDA graphs (decode, verification and drafting chains) captured during the
        # timed round (its first steps of a shape the warm-up did not reach); null: no graphs
        "graph_captures_timed": steps.graph_captures,
        # the decode steps in which they were captured, left out of every figure above
        "capture_steps_timed": sum(captured),
        "capture_seconds_timed": sum(t for t, cap in zip(step_times, captured) if cap),
        "warmup_rounds": warmup_rounds,
        # DSpark's measured over profiled step times at the end (plain, speculating), and
        # the steps behind each; null where the profile is taken as it is
        "cost_scales": [extra[f"spec_cost_scale_{k}"] for k in ("plain", "speculating")] if costs else None,
        "cost_steps": [int(extra[f"spec_cost_steps_{k}"]) for k in ("plain", "speculating")]
        if costs
        else None,
        "_trace": trace,
        "_full": full,
        "_steady": steady,
        "_decode_only": decode_only,
        "_step_tokens": step_tokens,
        "_decoders": steps.decoders,
        "_steps": steps.log,
    }


def _spec_counts(spec: Any) -> tuple[int, int, int]:
    """The speculation counters so far (drafted, verified, accepted); zeros without speculation."""
    return (spec.stats.drafted, spec.stats.verified, spec.stats.accepted) if spec is not None else (0, 0, 0)


def _share(seconds: list[float], part: list[bool], *masks: list[bool]) -> float:
    """The share of the steps' time (those where every mask holds) spent in ``part``'s steps."""
    kept = [(t, p) for t, p, *m in zip(seconds, part, *masks) if all(m)]
    total = sum(t for t, _ in kept)
    return sum(t for t, p in kept if p) / total if total > 0 else 0.0


def window_rate(tokens: list[int], seconds: list[float], *masks: list[bool]) -> float:
    """Tokens per second over the steps where every mask holds (0.0 where none does)."""
    keep = [all(m) for m in zip(*masks)] if masks else [True] * len(tokens)
    secs = sum(t for t, k in zip(seconds, keep) if k)
    return sum(n for n, k in zip(tokens, keep) if k) / secs if secs else 0.0
