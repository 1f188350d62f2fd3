"""Speculative decoding on the trained preset: no speculation, fixed K = 1..5, DSpark and
its two-step-lagged variant, at several concurrencies, with the step profile measured in
the same run.

For each concurrency ``c`` and policy, an `EngineCore` takes ``c`` held-out prompts
(heldout-v1 windows; prompt ``k`` has ``--prompt-tokens`` minus ``k`` mod 128 tokens, 128
being the model's compression period, so that requests do not decode in a lockstep that only
plain decoding keeps: `engine.prompts.staggered`) at once and decodes ``--tokens``
greedy tokens for each (EOS ignored, prefix caching off). Only the decode phase is timed:
the first step (every prefill, the first tokens) is not, nor an untimed warm-up round on the
same engine before it (``--warmup-tokens``: the policy's acceptance estimates and torch are
then warm, as on a serving engine; where the engine runs CUDA graphs, the warm-up takes the
whole prompts and as many tokens as the timed round, so that the graphs the timed round
replays are captured before it, repeated (up to 3 rounds) until a round captures nothing new:
``graph_captures_timed`` counts those captured in the timed round all the same, and the steps
that captured them are left out of the throughputs, counted in ``capture_steps_timed`` and
``capture_seconds_timed``: a serving engine captures a shape once in its life, and the bench
measures its steady state).
The windows are drawn once, for the largest concurrency (``M x c``), and each concurrency takes
the first of them, so a figure at 60 requests depends on the largest concurrency run beside it;
``--prompt-phase F`` moves every window by a share of their spacing, another sample of the
text, to see how much a figure owes to the prompts drawn.
Reported per run:

* **verified per step**: drafts put into verification per step, summed over the batch;
* **accepted length**: tokens a request emits per step (1 + its accepted drafts);
* **throughput**: tokens emitted in the decode phase / its wall time, the median of
  ``--repeats`` runs made in turn with the other policies (of an even count, the higher of
  the middle two: every field of the kept run is that run's own);
* the policies chosen (``dspark`` may verify a uniform K, or nothing, where selection does
  not pay);
* **full-batch throughput** (``full_batch_tokens_per_s``, and the table's ``dspark / best,
  full batch``): the same over the steps in which all ``c`` requests decode. Under
  speculation requests finish at different steps, and the rest then decode at smaller
  batches that plain decoding never runs; a serving engine would refill them. Without
  ``--requests-per-slot`` the targets judge the whole runs;
* **steady throughput** (``--requests-per-slot M`` > 1; ``steady_tokens_per_s``, the table's
  ``steady`` columns): ``M x c`` prompts, at most ``c`` decoding at a time, each finished
  request's slot refilled with the next prompt, as a serving engine at concurrency ``c``
  runs. Its figure covers the steps while prompts still wait for a slot (the ramp-down
  after the last one starts is left out) and counts decode tokens only (a prompt's first
  token is its prefill's). The throughput targets then judge it. On the wall clock the refill
  prompts' prefills run inside those steps; priced by ``--priced-by``, only the decode steps
  are priced (a disaggregated deployment's prefill pool runs the prompts). Requests of one
  length finish together under plain decoding, so each wave of refills is one step of ``c``
  prompts, where speculation spreads them over several steps of a few; ``--finish-spread
  S`` shortens request ``k`` by ``k mod S`` tokens, so that every policy's requests finish
  and refill over ``S`` steps, as independent requests' do. ``steady_prompt_steps`` counts
  the steady steps that computed refills' prompts (a step's log row has their tokens), and
  ``steady_prompt_time_share`` their share of the steady time; ``steady_decode_tokens_per_s``
  (the table's ``steady decode steps``) is the steady figure over the other steps, what a
  decode pool fed by a prefill pool runs. It is reported, not judged.

**Oracle.** The fixed-5 run records each request's confidences and how many of its 5
drafts were accepted at every step (``L``). On that trace, with the profile of this run,
the oracle verifies exactly ``L`` drafts (every verified draft accepted); its throughput
is ``sum(1 + L) / seconds(c, T)``. The same model also prices fixed-5 and DSpark on the
trace, so the modelled and the measured figures can be compared.

**Selection replay** (``selection_replay``, `selection_replay`). On the same trace: how much
accepted length the confidence head's ranking keeps as fewer drafts are verified (the
curve, and its value at 25 % fewer), and where DSpark's selection lands on it when
speculation stays on, priced by this machine's profile and the H200's. It separates the
head's quality from the cost regime that decides whether selection runs at all.

**Another machine's costs** (``--priced-by FILE``). A step profile measured elsewhere, for
example at DeepSeek-V4-Flash's widths on a GPU (``--width-profile flash-shape --device cuda``:
`engine.spec.profiling.measure_width_profiles` at two or more depths, `extrapolate_layers` to
43 by least squares; ``--width-from`` refits earlier runs' measurements together;
``--width-ep N`` times one rank of an EP N decode instance instead, its share of the routed
experts receiving its own tokens' rows, the exchange not timed).
DSpark's engines then schedule by it, so their measured verified drafts and accepted lengths
are what DSpark chooses under those costs; every run's decode steps are priced by it (each
step at its batch, verified drafts and drafting depth: ``tokens_per_s``, with the wall-clock
figure kept as ``measured_tokens_per_s``), and the targets judge the priced throughputs.

**Targets** (the JSON's ``targets``, `declare_targets`): DSpark within 2 % of the best of
plain decoding and fixed K at every concurrency; from 32 requests at most 75 % of fixed-5's
verified drafts at 97 % of its accepted length; at 60 requests fixed-5 + 4 %. Where DSpark
turned speculation off on every timed step, the targets it grades carry a ``note``: against
plain decoding as the best, its ratio compares two runs of plain decoding (on a GPU, two
engines whose plain steps can differ by more than the 2 %), and the box has nothing selected.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.spec.profile import SpecProfile, spec_steps_file  # pure: numpy, no torch
from services.bench import Report, progress
from services.bench._spec_profiles import device_name, profile_table, width_profile
from services.bench._spec_replay import (
    acceptance,
    modelled,
    priced_window,
    selection_replay,
)
from services.bench._spec_report import declare_targets, table_row
from services.bench._spec_run import run_policy as _run
from services.bench._spec_run import window_rate as window_rate  # re-exported (tests)

CONCURRENCY = (1, 8, 16, 32, 60, 128)
POLICIES = ("none", "fixed-1", "fixed-2", "fixed-3", "fixed-4", "fixed-5", "dspark", "dspark-lagged")


# the step profile an H200 measured for a checkpoint (`--save-profile --device cuda` there),
# reported beside the profile of the machine the bench runs on
H200_SPEC_STEPS_FILE = spec_steps_file("NVIDIA H200")
# --scheduling: EngineConfig.async_scheduling (a speculating step is synchronous either way)
SCHEDULING = {"engine": None, "sync": False, "async": True}


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _phase(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default="models/trained", help="checkpoint with an MTP layer (default the trained preset)"
    )
    p.add_argument(
        "--concurrency", default=",".join(map(str, CONCURRENCY)), help="comma-separated request counts"
    )
    p.add_argument("--tokens", type=int, default=48, help="tokens generated per request (default 48)")
    p.add_argument("--prompt-tokens", type=int, default=256, help="held-out prompt length (default 256)")
    p.add_argument(
        "--prompt-phase", type=_phase, default=0.0, metavar="F",
        help="move every held-out window's start by F (0 <= F < 1) of the spacing between windows: "
        "another sample of the same text, to see how much the figures owe to the prompts drawn (default 0)",
    )  # fmt: skip
    p.add_argument("--profile-steps", type=int, default=8, help="timed steps per profile cell (default 8)")
    p.add_argument(
        "--profile-rounds", type=_at_least_one, default=2,
        help="fresh engines per profile cell, interleaved, the fastest kept (default 2): more where the "
        "host's speed changes from second to second (docs/benchmarks.md, 'The host's speed flips')",
    )  # fmt: skip
    p.add_argument("--policies", default=",".join(POLICIES), help="policies to run")
    p.add_argument(
        "--save-profile",
        action="store_true",
        help="also write the measured profile beside the checkpoint, named after this machine (spec_steps_file)",
    )
    p.add_argument(
        "--profile-from", default=None, metavar="FILE",
        help="use this profile (a sluice_spec_steps.json measured on this machine) instead of measuring one",
    )  # fmt: skip
    p.add_argument(
        "--warmup-tokens", type=int, default=16,
        help="an untimed round first on each engine: every request's first 64 prompt tokens, this many "
        "generated (the policy's acceptance rates and torch warm up, as on a serving engine; default 16); "
        "with CUDA graphs, the whole prompts and at least --tokens",
    )  # fmt: skip
    p.add_argument(
        "--priced-by", default=None, metavar="FILE",
        help="a step profile of another machine or width (--width-profile's): DSpark's engines schedule by "
        "it, and every run's measured steps are priced by it (tokens_per_s; the wall clock's is kept as "
        "measured_tokens_per_s); the targets judge the priced throughputs. Without --profile-from, this "
        "machine's profile is not measured (the fixed policies do not use one)",
    )  # fmt: skip
    p.add_argument(
        "--width-profile", default=None, metavar="PRESET",
        help="instead of the runs: measure the step profile of a generated preset's widths (flash-shape: "
        "DeepSeek-V4-Flash's) with random weights at --width-depths and extrapolate it to --width-layers "
        "decoder layers (extrapolate_layers); written to --width-out",
    )  # fmt: skip
    p.add_argument(
        "--width-depths", default="1,3",
        help="--width-profile: decoder depths (default 1,3); every depth's cells enter the least-squares "
        "line (fit_residuals: each measurement against it)",
    )  # fmt: skip
    p.add_argument(
        "--width-from", default=None, metavar="FILES",
        help="comma-separated --width-profile --json reports: their measured depths enter the fit too "
        "(without --width-profile, nothing is measured: a refit, no device needed)",
    )  # fmt: skip
    p.add_argument(
        "--width-layers",
        type=int,
        default=43,
        help="--width-profile: the real depth (default 43, V4-Flash's)",
    )
    p.add_argument("--width-batches", default="1,8,16,32,64,128", help="--width-profile: batch sizes")
    p.add_argument(
        "--width-ep", type=int, default=1, metavar="N",
        help="--width-profile: time one rank of an EP N decode instance instead of the whole model on one "
        "device: the rank's share of the routed experts, receiving its own tokens' rows (a balanced "
        "exchange); the exchange is not timed (engine.spec.profiling.rank_experts; default 1)",
    )  # fmt: skip
    p.add_argument(
        "--width-rounds", type=int, default=2,
        help="--width-profile: fresh engines per cell, the fastest kept; the rounds interleave every depth's cells (default 2: the slope is multiplied)",
    )  # fmt: skip
    p.add_argument("--width-out", default=None, help="--width-profile: the extrapolated profile's JSON file")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", default=None, help="engine dtype (default float32 on cpu, bfloat16 on cuda)")
    p.add_argument(
        "--scheduling", choices=sorted(SCHEDULING), default="engine",
        help="the engines' step loop: the engine's own choice (synchronous, what sluice serve runs), "
        "or forced synchronous / asynchronous (default engine)",
    )  # fmt: skip
    p.add_argument(
        "--requests-per-slot", type=_at_least_one, default=1,
        help="prompts per concurrency slot (default 1: c requests, then the batch drains). With M > 1, "
        "M x c requests run c at a time, each finished one's slot refilled: the steady_* figures cover "
        "the steps while prompts wait (decoding at concurrency c), and the throughput targets judge them",
    )  # fmt: skip
    p.add_argument(
        "--finish-spread", type=_at_least_one, default=1, metavar="STEPS",
        help="request k generates --tokens minus (k mod STEPS) tokens, so that requests finish, and their "
        "slots refill, over STEPS steps, as independent requests do (default 1: every request generates "
        "--tokens, and under plain decoding they finish, and refill, in one step)",
    )  # fmt: skip
    p.add_argument(
        "--repeats", type=int, default=3,
        help="runs per policy, interleaved; the median run is kept (the higher middle one of an even count)",
    )  # fmt: skip
    p.add_argument(
        "--profile-as-is", action="store_true",
        help="DSpark takes the profile as it is: no rescaling by the engine's own step times (the default "
        "rescales plain and speculating steps' prices by what they took; --priced-by implies this)",
    )  # fmt: skip
    p.add_argument(
        "--step-log", action="store_true",
        help="keep each kept run's decode steps in the JSON (`steps`: per step its ms, tokens emitted, drafts "
        "it could verify, drafts it verified, drafts accepted, the depth it drafted for the next step, and "
        "whether it captured a CUDA graph): where a policy's time went, step by step",
    )  # fmt: skip
    p.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (default 1: stable on shared CPUs)"
    )


def _h200_profile(model: Path, device: str) -> dict[str, Any] | str:
    """The H200's table beside this machine's: this run's own on a GPU, else the one measured
    on an H200 and shipped with the checkpoint (``H200_SPEC_STEPS_FILE``), when there is one."""
    if device.startswith("cuda"):
        return f"this run's profile (measured on {device_name(device)})"
    path = model / H200_SPEC_STEPS_FILE
    if not path.is_file():
        return f"none shipped with this checkpoint ({H200_SPEC_STEPS_FILE})"
    return profile_table(SpecProfile.load(path), f"measured on an H200, shipped as {path}")


def run(args: argparse.Namespace) -> Report:
    """The bench: the step profile (`_profiles`; or ``--width-profile`` / ``--width-from``'s
    instead of the runs), then at each concurrency every policy's kept runs (`_policy_runs`),
    the fixed-5 trace's replays, the table's row and the targets."""
    import torch

    from engine.prompts import heldout_prompts, phase_period, staggered
    from engine.spec.profile import SPEC_STEPS_FILE
    from engine.spec.profiling import device_steps_file

    torch.set_num_threads(args.threads)
    model = Path(args.model)
    conc = [int(x) for x in args.concurrency.split(",") if x.strip()]
    per_slot = args.requests_per_slot
    if args.finish_spread > args.tokens:
        raise ValueError(f"--finish-spread {args.finish_spread} exceeds --tokens {args.tokens}")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    report = Report(
        "spec",
        config={
            "model": str(model), "concurrency": conc, "tokens": args.tokens, "prompt_tokens": args.prompt_tokens,
            "policies": policies, "torch_threads": torch.get_num_threads(), "prompts": "heldout-v1 windows",
            "repeats": args.repeats, "warmup_tokens": args.warmup_tokens, "requests_per_slot": per_slot,
            # what the throughput targets judge: the steady steps when slots are refilled, else whole runs
            "throughput_judged": "steady" if per_slot > 1 else "whole run",
        },
    )  # fmt: skip
    engine_kwargs = {
        "device": args.device,
        "dtype": args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"),
        "async_scheduling": SCHEDULING[args.scheduling],
    }
    report.config.update(engine_kwargs)
    t_start = time.perf_counter()
    if args.width_profile or args.width_from:
        return width_profile(args, report, engine_kwargs)
    profile, priced, replay_profiles = _profiles(args, report, model, conc, engine_kwargs, t_start)
    period = phase_period(model)  # prompt k is k mod period ids shorter: no lockstep (`staggered`)
    prompts_all = staggered(
        heldout_prompts(model, max(conc) * per_slot, args.prompt_tokens, args.prompt_phase), period
    )
    report.config["prompt_phase"] = args.prompt_phase
    report.config["prompt_lengths"] = f"{args.prompt_tokens} - (k mod {period}) for prompt k"
    report.config["output_lengths"] = f"{args.tokens} - (k mod {args.finish_spread}) for request k"
    with tempfile.TemporaryDirectory(prefix="sluice-bench-spec-") as tmp:
        ppath = Path(tmp) / SPEC_STEPS_FILE
        ppath.write_text(profile.to_json())
        # DSpark's engines schedule by --priced-by's profile when given (it is that machine's choice
        # being measured); the fixed policies ignore the profile
        dspark_path = Path(args.priced_by) if args.priced_by else ppath
        # --priced-by's profile is another machine's, to be followed here, not rescaled to this one
        measured_costs = not (args.priced_by or args.profile_as_is)
        report.config["measured_costs"] = measured_costs
        if args.save_profile:  # where this machine's engines look for it
            (model / device_steps_file(args.device)).write_text(profile.to_json() + "\n")
        judged = "steady_tokens_per_s" if per_slot > 1 else "tokens_per_s"
        for c in conc:
            runs = _policy_runs(
                args, model, prompts_all[: c * per_slot], c, policies, ppath, dspark_path,
                engine_kwargs, measured_costs, priced, judged,
            )  # fmt: skip
            trace = runs.get("fixed-5", {}).get("_trace")
            extra: dict[str, Any] = {}
            if trace:
                extra = modelled(trace, priced or profile, c) | {"acceptance_by_position": acceptance(trace)}
                extra["selection_replay"] = selection_replay(trace, replay_profiles)
            for r in runs.values():
                _drop_private(r, keep_steps=args.step_log)
            report.results[f"c{c}"] = {**runs, **extra}
            report.rows.append(table_row(c, runs, extra, judged))
            declare_targets(report, c, runs, judged)
    report.results["wall_s"] = round(time.perf_counter() - t_start, 1)
    return report


def _profiles(
    args: argparse.Namespace,
    report: Report,
    model: Path,
    conc: list[int],
    engine_kwargs: dict[str, Any],
    t_start: float,
) -> tuple[SpecProfile, SpecProfile | None, dict[str, SpecProfile]]:
    """The step profile of the runs (``--profile-from``'s, else ``--priced-by``'s, else measured
    here at the concurrencies ``conc``), ``--priced-by``'s (None without it), and the profiles
    that price the selection replay; their tables go into ``report``."""
    from engine.spec.profiling import measure_spec_profile

    if args.profile_from:
        profile = SpecProfile.load(args.profile_from)
        source = f"loaded from {args.profile_from}"
    elif args.priced_by:  # every policy that reads a profile reads --priced-by's
        profile = SpecProfile.load(args.priced_by)
        source = f"--priced-by's ({args.priced_by}); this machine's was not measured"
    else:
        profile = measure_spec_profile(
            model, sorted(set(conc)), prompt_tokens=args.prompt_tokens, steps=args.profile_steps,
            rounds=args.profile_rounds, progress=progress, device=engine_kwargs["device"], dtype=engine_kwargs["dtype"],
        )  # fmt: skip
        source = "measured by this run"
        progress(f"profile measured in {time.perf_counter() - t_start:.0f} s")
    report.results["profile"] = profile_table(profile, source)
    report.results["h200_profile"] = _h200_profile(model, args.device)
    replay_profiles = {"this machine": profile}  # what prices the selection replay
    priced = SpecProfile.load(args.priced_by) if args.priced_by else None
    if priced is not None:
        report.config["priced_by"] = args.priced_by
        report.results["priced_by_profile"] = profile_table(priced, f"loaded from {args.priced_by}")
        replay_profiles["priced by"] = priced
    if not args.device.startswith("cuda") and (model / H200_SPEC_STEPS_FILE).is_file():
        replay_profiles["H200"] = SpecProfile.load(model / H200_SPEC_STEPS_FILE)
    return profile, priced, replay_profiles


def _policy_runs(
    args: argparse.Namespace,
    model: Path,
    prompts: list[list[int]],
    c: int,
    policies: list[str],
    profile_path: Path,
    dspark_path: Path,
    engine_kwargs: dict[str, Any],
    measured_costs: bool,
    priced: SpecProfile | None,
    judged: str,
) -> dict[str, dict[str, Any]]:
    """Every policy at concurrency ``c``, ``--repeats`` runs each (priced by ``priced`` when
    given), and of each policy's runs the median by ``judged``, with every run's figure beside
    it (``tokens_per_s_runs``). DSpark's engines read the profile at ``dspark_path``, the
    others at ``profile_path``."""
    from engine.spec.profiling import release_memory

    tries: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    for rep in range(args.repeats):  # interleaved, so that a burst of load hits every policy alike
        for policy in policies:
            t0 = time.perf_counter()
            path = dspark_path if policy.startswith("dspark") else profile_path
            r = _run(
                model, prompts, args.tokens, policy, path, engine_kwargs,
                args.warmup_tokens, concurrency=c, measured_costs=measured_costs,
                finish_spread=args.finish_spread,
            )  # fmt: skip
            release_memory(engine_kwargs)  # the engine is unreachable only once `_run` returned
            if priced is not None:
                _price(r, priced)
            tries[policy].append(r)
            steady = f" (steady {r['steady_tokens_per_s']:.1f})" if args.requests_per_slot > 1 else ""
            probes = f", {r['probes']} probe(s)" if r["probes"] else ""
            progress(
                f"c={c} {policy} #{rep + 1}: {r['tokens_per_s']:.1f} tok/s{steady}, {r['verified_per_step']:.1f} "
                f"verified/step ({r['verified_per_sequence']:.2f} a sequence), accepted length {r['accepted_length']:.2f}{probes} "
                f"({time.perf_counter() - t0:.0f} s)"
            )
    runs: dict[str, dict[str, Any]] = {}
    for policy, rs in tries.items():
        ordered = sorted(rs, key=lambda r: r[judged])
        median = dict(ordered[len(ordered) // 2])
        median["tokens_per_s_runs"] = [round(r[judged], 2) for r in rs]
        runs[policy] = median
    return runs


def _drop_private(r: dict[str, Any], keep_steps: bool) -> None:
    """A kept run as the JSON reports it: the per-step lists left out, but its step log with
    ``--step-log``."""
    if keep_steps:
        r["steps"] = r["_steps"]
    for private in ("_trace", "_full", "_steady", "_decode_only", "_step_tokens", "_decoders", "_steps"):
        r.pop(private, None)


def _price(r: dict[str, Any], priced: Any) -> None:
    """A run's throughputs as ``priced`` (--priced-by's profile) prices its decode steps; the
    wall clock's are kept under ``measured_*``."""
    trace = r["_trace"]
    for key, mask in (
        ("tokens_per_s", [True] * len(r["_step_tokens"])),
        ("full_batch_tokens_per_s", r["_full"]),
        ("steady_tokens_per_s", r["_steady"]),
        ("steady_decode_tokens_per_s", [k and d for k, d in zip(r["_steady"], r["_decode_only"])]),
    ):
        r["measured_" + key] = r[key]
        r[key] = priced_window(r, trace, priced, mask)


def main(argv: list[str] | None = None) -> None:
    from services.bench import module_main

    module_main("spec", add_arguments, run, argv)


if __name__ == "__main__":
    main()
