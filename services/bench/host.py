"""The host's share of an engine decode step: `EngineCore.step` with the model's forward replaced
by a stub that returns fixed logits at once.

What is left is everything a synchronous step does on the CPU around the forward: the
scheduler (admission, block growth, the step's sequences), the batch's inputs
(`ForwardBatch.from_sequences`, one upload), sampling (one argmax over the step's rows for
greedy requests) and the outputs (token bookkeeping, stop checks, the messages). On a GPU
this time adds to the device's in a synchronous step, so it bounds how close a decode step
gets to the memory roofline at large batches.

The model is the ``tiny`` preset's config with seeded random weights (the prompts are
prefilled by the real forward before the stub goes in); the vocabulary is the real one
(129,280), so the argmax reads a real-sized row per request. ``batch`` greedy requests of
32 prompt tokens decode; after ``--warmup`` steps, ``--steps`` steps are timed one by one
and the median is reported, with the time per sequence; and the median of an argmax over
the step's logits rows alone, timed after them: on this CPU it is real work inside the step,
on a GPU it is one launch, so ``us/sequence without it`` is the host's own share.

``--speculative fixed-K``: speculating steps instead, as the GPU runs them (the CUDA graphs'
padded batches, `decode_graphs="padded"`): each step verifies ``K`` drafts per request and
drafts ``K`` for the next. The stubs replace the main model's layers (`final_hidden`, every
token's row zero) and the drafting chain's MTP passes (`DraftGraphs._passes`: the first
``--accept`` drafts the target's own token, the rest another), so what is timed is the host's
side of such a step: the policy, the staging and putting back of ring rows, the graphs'
inputs, verification's sampling and acceptance, the drafting chain's inputs, the
bookkeeping of ``--accept`` + 1 tokens a request, and the outputs. On the CPU the ring copies
and the argmax are real work, small at the ``tiny`` widths; on a GPU they are launches.

``--phases``: the mean wall time a timed step spends inside each of the step's main functions
(PHASES; a caller's time includes what it calls), to show where the host side goes.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.bench import Report, module_main, progress


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", default="1,16,64,256", help="requests per step, a comma list")
    p.add_argument("--steps", type=int, default=200, help="timed steps per batch (default 200)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    p.add_argument(
        "--speculative", default=None, metavar="fixed-K",
        help="time speculating steps verifying and drafting K drafts a request (module docstring)",
    )  # fmt: skip
    p.add_argument(
        "--accept", type=int, default=3,
        help="with --speculative: drafts accepted a request a step (default 3)",
    )  # fmt: skip
    p.add_argument(
        "--phases", action="store_true",
        help="also time the step's phases (PHASES: wall time inside each, nested ones inside their callers)",
    )  # fmt: skip


# (module, class, method): the step's phases `--phases` times, callers before what they call
PHASES = (
    ("engine.scheduler.scheduler", "Scheduler", "schedule"),
    ("engine.scheduler.scheduler", "Scheduler", "_plan_drafts"),
    ("engine.executor", "ModelExecutor", "launch"),
    ("engine.executor", "ModelExecutor", "_inputs"),
    ("engine.spec.speculation", "Speculation", "stage"),
    ("engine.forward_batch", "ForwardBatch", "from_sequences"),
    ("engine.cuda_graphs", "DecodeGraphs", "run"),
    ("engine.executor", "ModelExecutor", "_sample_on_device"),
    ("engine.executor", "ModelExecutor", "finish"),
    ("engine.executor", "ModelExecutor", "_sample_seqs"),
    ("engine.spec.speculation", "Speculation", "draft"),
    ("engine.spec.draft_graphs", "DraftGraphs", "_host_inputs"),
    ("engine.spec.speculation", "Speculation", "undo_rejected"),
    ("engine.scheduler.scheduler", "Scheduler", "update"),
    ("engine.outputs", "Outputs", "collect"),
)

TOKEN = 7  # the stubbed target's argmax everywhere
OTHER = 9  # a draft the target refuses


def argmax_ms(rows: int, vocab: int, steps: int) -> float:
    """Median ms of one argmax over ``rows`` logits rows of ``vocab`` on this CPU: the part of a
    timed step that is device work on a GPU (greedy sampling's one argmax over the step's rows)."""
    import torch

    logits = torch.zeros(rows, vocab)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits.argmax(-1)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def probe_seconds(size: int = 3000) -> float:
    """Seconds of a fixed pure-Python workload (``size`` updates of a 512-entry dict, which fits
    the L1 cache): its work never changes, so where it takes longer the thread ran slower (the
    machine), which tells a slower host from a step that did more (scripts/host_speed_flips.py)."""
    t0 = time.perf_counter()
    d: dict[int, int] = {}
    for i in range(size):
        d[i & 511] = d.get(i & 511, 0) + i
    return time.perf_counter() - t0


@dataclass
class HostTimes:
    step_ms: float  # median `EngineCore.step`
    argmax_ms: float  # `argmax_ms` over such a step's rows
    phases_ms: dict[str, float] | None  # with phases: mean ms a timed step inside each of PHASES


@contextlib.contextmanager
def _phase_timers(
    timing: list[bool], phases: tuple[tuple[str, str, str], ...]
) -> Iterator[dict[str, list[float]]]:
    """Every method of ``phases`` (PHASES' form) wrapped to add its wall time while
    ``timing[0]`` holds; put back on exit."""
    import importlib

    spent: dict[str, list[float]] = {}
    undo = []
    for module, cls_name, name in phases:
        cls = getattr(importlib.import_module(module), cls_name)
        raw = inspect.getattr_static(cls, name)
        kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
        fn = raw.__func__ if kind else raw
        key = f"{cls_name}.{name}"

        def timed(*a: Any, _fn: Any = fn, _key: str = key, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                if timing[0]:
                    spent.setdefault(_key, []).append(time.perf_counter() - t0)

        setattr(cls, name, kind(timed) if kind else timed)
        undo.append((cls, name, raw))
    try:
        yield spent
    finally:
        for cls, name, raw in undo:
            setattr(cls, name, raw)


def time_host_steps(
    model_dir: Path, batch: int, steps: int, warmup: int, speculative: str | None = None, accept: int = 0,
    phases: bool = False,
) -> HostTimes:  # fmt: skip
    """Median ms of `EngineCore.step` over ``steps`` decode steps of ``batch`` requests, the
    forward stubbed (module docstring; ``speculative``: speculating steps, ``accept`` drafts
    accepted a request a step), `argmax_ms` over such a step's rows (one a request, or
    ``K + 1`` speculating), and with ``phases`` the mean ms of each of PHASES in them."""
    timing = [False]
    with _phase_timers(timing, PHASES if phases else ()) as spent:
        step_ms, rows, vocab = _timed_steps(model_dir, batch, steps, warmup, speculative, accept, timing)
    names = [f"{cls}.{name}" for _, cls, name in PHASES]  # callers first
    per_step = {k: sum(spent.get(k, ())) * 1e3 / steps for k in names} if phases else None
    return HostTimes(step_ms, argmax_ms(rows, vocab, steps), per_step)


def _timed_steps(
    model_dir: Path, batch: int, steps: int, warmup: int, speculative: str | None, accept: int,
    timing: list[bool],
) -> tuple[float, int, int]:  # fmt: skip
    """`time_host_steps`'s steps: (median ms, the step's logits rows, the vocabulary)."""
    import torch

    from engine.core import EngineCore
    from engine.engine_config import EngineConfig
    from engine.messages import CoreRequest
    from engine.runner import RunnerOutput
    from engine.sampling.params import SamplingParams

    depth = int(speculative.split("-")[1]) if speculative else 0
    per_step = 1 + min(accept, depth)  # tokens a request emits a step
    total = (steps + warmup) * per_step + 8
    spec = {"speculative": speculative, "decode_graphs": "padded"} if speculative else {}
    core = EngineCore(
        EngineConfig(
            model=str(model_dir), random_weights=0, num_blocks=batch * (2 + total // 256) + 4,
            num_swa_slots=batch, max_num_seqs=batch, enable_prefix_caching=False, **spec,
        )
    )  # fmt: skip
    try:
        params = SamplingParams(temperature=0.0, max_tokens=total, ignore_eos=True)
        for i in range(batch):
            core.add(CoreRequest(f"r{i}", tuple(range(5 + i, 37 + i)), params))
        started: set[str] = set()
        while len(started) < batch:  # the prompts, by the real forward
            started.update(o.request_id for o in core.step() if o.new_token_ids)
        runner = core.runner
        if speculative:
            _stub_speculating(core, batch * (depth + 1) * 2, depth, accept)
        else:
            logits = torch.zeros(batch, core.vocab_size)
            logits[:, TOKEN] = 1.0
            hidden = torch.zeros(batch, 1, 1)
            runner.execute = lambda b: RunnerOutput(logits[: b.num_seqs], hidden[: b.num_seqs])
        for _ in range(max(warmup, 1) if speculative else warmup):  # the stubs' drafts first
            core.step()
        before = core.stats().extra
        times = []
        timing[0] = True
        for _ in range(steps):
            t0 = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - t0)
        timing[0] = False
        if speculative:  # the timed steps' drafts accepted, as the stubs make them
            after = core.stats().extra
            accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
            accepted /= max(after["spec_steps"] - before["spec_steps"], 1)
            if accepted != batch * min(accept, depth):
                raise RuntimeError(
                    f"{accepted:.1f} drafts accepted a step, expected {batch * min(accept, depth)}"
                )
        return statistics.median(times) * 1e3, batch * (depth + 1), core.vocab_size
    finally:
        core.close()


def _stub_speculating(core: Any, rows: int, depth: int, accept: int) -> None:
    """The main model's layers and the drafting chain's passes replaced (module docstring)."""
    import torch

    model = core.runner.model
    cfg = model.cfg
    final = torch.zeros(rows, cfg.hidden_size)
    streams = torch.zeros(rows, cfg.hc_mult, cfg.hidden_size)
    logits = torch.zeros(rows, core.vocab_size)
    logits[:, TOKEN] = 1.0
    model.final_hidden = lambda batch, pool, swa: (final[: batch.num_tokens], streams[: batch.num_tokens])
    model.logits = lambda h: logits[: h.shape[0]]
    drafts = torch.full((depth, rows), OTHER, dtype=torch.long)
    drafts[:accept] = TOKEN
    conf = torch.full((depth, rows), 0.5)
    chains = core.executor.drafter.graphs
    assert chains is not None, "padded decode graphs give the drafter its chains"
    chains._passes = lambda chain: (
        drafts[: chain.live.shape[0], : chain.live.shape[1]],
        conf[: chain.live.shape[0], : chain.live.shape[1]],
    )


def run(args: argparse.Namespace) -> Report:
    import torch

    from engine.checkpoint.generate import write_config_dir

    torch.set_num_threads(1)
    batches = [int(x) for x in args.batches.split(",") if x.strip()]
    spec = args.speculative
    if spec is not None and not (spec.startswith("fixed-") and spec[6:].isdigit() and int(spec[6:]) >= 1):
        raise SystemExit(f"--speculative takes fixed-K (K >= 1), not {spec!r}")
    report = Report(
        "host",
        {
            "batches": batches, "steps": args.steps, "warmup": args.warmup, "preset": "tiny",
            "speculative": spec, "accept": args.accept if spec else None, "phases": args.phases,
        },
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="sluice-bench-host-") as tmp:
        model = write_config_dir("tiny", Path(tmp) / "tiny", seed=0)
        for b in batches:
            times = time_host_steps(model, b, args.steps, args.warmup, spec, args.accept, args.phases)
            ms, top = times.step_ms, times.argmax_ms
            report.results[str(b)] = {
                "ms_per_step": ms, "us_per_sequence": ms * 1e3 / b, "argmax_ms": top,
                "us_per_sequence_without_argmax": (ms - top) * 1e3 / b,
            }  # fmt: skip
            if times.phases_ms is not None:
                report.results[str(b)]["phases_ms"] = times.phases_ms
                for name, phase_ms in times.phases_ms.items():
                    progress(f"host: batch {b}: {phase_ms:7.3f} ms a step in {name}")
            report.rows.append({
                "batch": b, "host ms/step": round(ms, 3), "us/sequence": round(ms * 1e3 / b, 1),
                "of which argmax ms": round(top, 3), "us/sequence without it": round((ms - top) * 1e3 / b, 1),
            })  # fmt: skip
            progress(
                f"host: batch {b}: {ms:.3f} ms a step ({top:.3f} ms of it the argmax, device work on a GPU)"
            )
    return report


def main() -> None:
    """``python -m services.bench.host`` (same as ``sluice bench host``)."""
    module_main("host", add_arguments, run, None)


if __name__ == "__main__":
    main()
