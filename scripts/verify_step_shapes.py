"""What a verification step costs by its shape: every row verifying the same drafts, or one
row verifying many while the others verify few (a DSpark selection's shape).

One runner at a generated preset's widths, random weights built on the device (as `sluice
bench spec --width-profile` builds them; ``--ep N``: one EP N rank's share of the routed
experts, `engine.spec.profiling.rank_experts`). ``--rows`` sequences hold ``--context``
tokens each; then, for each shape, verification-shaped steps (teacher-forced tokens with
logits at every one, as a speculating engine's verification step brings them) run on the
runner's decode graphs (CUDA) or eagerly, every step at the same positions (its values are
not checked, only its time). Printed per shape: tokens in the step and the median step
time (synchronised), and the device time by the CUDA profiler.

    python3 scripts/verify_step_shapes.py --preset flash-shape --ep 32 --layers 8 --rows 64 --device cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="flash-shape")
    ap.add_argument("--ep", type=int, default=1, help="time one rank of EP N (its share of the experts)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024, help="tokens each row holds before the steps")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=20, help="steps timed per shape")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import torch

    from engine.config import BLOCK_TOKENS, ModelConfig
    from engine.forward_batch import ForwardBatch, SequenceInput
    from engine.runner import ModelRunner, RunnerConfig
    from engine.spec.profiling import rank_model_dir

    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model = rank_model_dir(args.preset, args.ep, args.layers, Path(tempfile.mkdtemp()) / "model")
    b, ctx = args.rows, args.context
    per_row = -(-(ctx + 8) // BLOCK_TOKENS)
    cfg = RunnerConfig(
        num_blocks=b * per_row + 2, num_slots=b, device=args.device,
        dtype="bfloat16" if cuda else "float32",
    )  # fmt: skip
    runner = ModelRunner.random(ModelConfig.from_dir(model), cfg, seed=0)
    gen = torch.Generator().manual_seed(0)
    vocab = runner.model_cfg.vocab_size
    tokens = torch.randint(3, vocab, (b, ctx + 8), generator=gen).tolist()
    tables = [list(range(i * per_row, (i + 1) * per_row)) for i in range(b)]
    for i in range(b):  # prompts one at a time: a row's prefill stays small
        runner.execute(
            ForwardBatch.from_sequences([SequenceInput(tokens[i][:ctx], 0, i, tables[i])], device=args.device)
        )
    sync()

    def step(lens: list[int]) -> ForwardBatch:
        seqs = [
            SequenceInput(tokens[i][ctx : ctx + q], ctx, i, tables[i], num_logits=q)
            for i, q in enumerate(lens)
        ]
        return ForwardBatch.from_sequences(seqs, device=args.device)

    shapes = {
        "every row 2 tokens (1 draft)": [2] * b,
        "every row 6 tokens (5 drafts)": [6] * b,
        "one row 6, the others 2": [6] + [2] * (b - 1),
        "half the rows 6, half 2": [6, 2] * (b // 2) + [2] * (b % 2),
    }
    results = []
    for name, lens in shapes.items():
        for _ in range(3):  # capture, warm-up
            runner.execute(step(lens))
        sync()
        walls = []
        for _ in range(args.steps):
            batch = step(lens)
            sync()
            t0 = time.perf_counter()
            runner.execute(batch)
            sync()
            walls.append(time.perf_counter() - t0)
        row = {"shape": name, "tokens": sum(lens), "median_ms": 1e3 * statistics.median(walls)}
        if cuda:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.steps):
                    runner.execute(step(lens))
                sync()
            busy = sum(e.self_device_time_total for e in prof.key_averages() if e.self_device_time_total > 0)
            row["device_ms"] = busy / 1e3 / args.steps
        results.append(row)
        print(
            f"{name:32s} {row['tokens']:5d} tokens  {row['median_ms']:8.2f} ms"
            + (f"  device {row['device_ms']:8.2f} ms" if cuda else ""),
            file=sys.stderr if args.json else sys.stdout,  # progress, beside the JSON
            flush=True,
        )
    if args.json:
        meta = {"preset": args.preset, "ep": args.ep, "layers": args.layers, "rows": b, "context": ctx}
        meta["device"] = torch.cuda.get_device_name() if cuda else "cpu"
        print(json.dumps({"meta": meta, "shapes": results}))


if __name__ == "__main__":
    main()
