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
and the median is reported, with the time per sequence.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from services.bench import Report, module_main, progress


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", default="1,16,64,256", help="requests per step, a comma list")
    p.add_argument("--steps", type=int, default=200, help="timed steps per batch (default 200)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")


def host_step_ms(model_dir: Path, batch: int, steps: int, warmup: int) -> float:
    """Median ms of `EngineCore.step` over ``steps`` decode steps of ``batch`` requests, the
    forward stubbed (module docstring)."""
    import torch

    from engine.core import EngineCore
    from engine.engine_config import EngineConfig
    from engine.messages import CoreRequest
    from engine.runner import RunnerOutput
    from engine.sampling.params import SamplingParams

    core = EngineCore(
        EngineConfig(
            model=str(model_dir), random_weights=0, num_blocks=2 * batch + 4, num_swa_slots=batch,
            max_num_seqs=batch, enable_prefix_caching=False,
        )
    )  # fmt: skip
    try:
        params = SamplingParams(temperature=0.0, max_tokens=steps + warmup + 8, ignore_eos=True)
        for i in range(batch):
            core.add(CoreRequest(f"r{i}", tuple(range(5 + i, 37 + i)), params))
        started: set[str] = set()
        while len(started) < batch:  # the prompts, by the real forward
            started.update(o.request_id for o in core.step() if o.new_token_ids)
        logits = torch.zeros(batch, core.vocab_size)
        logits[:, 7] = 1.0
        hidden = torch.zeros(batch, 1, 1)
        runner = core.runner
        runner.execute = lambda b: RunnerOutput(logits[: b.num_seqs], hidden[: b.num_seqs])
        for _ in range(warmup):
            core.step()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3
    finally:
        core.close()


def run(args: argparse.Namespace) -> Report:
    import torch

    from engine.checkpoint.generate import write_config_dir

    torch.set_num_threads(1)
    batches = [int(x) for x in args.batches.split(",") if x.strip()]
    report = Report(
        "host", {"batches": batches, "steps": args.steps, "warmup": args.warmup, "preset": "tiny"}
    )
    with tempfile.TemporaryDirectory(prefix="sluice-bench-host-") as tmp:
        model = write_config_dir("tiny", Path(tmp) / "tiny", seed=0)
        for b in batches:
            ms = host_step_ms(model, b, args.steps, args.warmup)
            report.results[str(b)] = {"ms_per_step": ms, "us_per_sequence": ms * 1e3 / b}
            report.rows.append(
                {"batch": b, "host ms/step": round(ms, 3), "us/sequence": round(ms * 1e3 / b, 1)}
            )
            progress(f"host: batch {b}: {ms:.3f} ms a step")
    return report


def main() -> None:
    """``python -m services.bench.host`` (same as ``sluice bench host``)."""
    module_main("host", add_arguments, run, None)


if __name__ == "__main__":
    main()
