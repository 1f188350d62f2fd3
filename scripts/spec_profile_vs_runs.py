"""Does the step profile price a speculating step as the engine's runs take it?

In one process, at one batch size: the profile's cells (`measure_spec_profile`), then runs
of plain decoding and fixed-K (the bench's `_run`, 2 x B prompts through B slots, two
rounds), comparing each run's median step while all B requests decode with the profile's
price of that step (`SpecProfile.uniform_seconds`). A bench run's median over all its steps
is no such comparison: from 8 requests up most of its steps are the batch draining.

    .venv/bin/python scripts/spec_profile_vs_runs.py --batch 16 --tokens 48 --fixed 1,3,5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/trained")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--fixed", default="1,3,5", help="the K of the fixed-K runs")
    args = ap.parse_args()

    import torch

    from engine.prompts import heldout_prompts, phase_period, staggered
    from engine.spec.profiling import measure_spec_profile
    from services.bench.spec import _run

    torch.set_num_threads(1)
    model, b = Path(args.model), args.batch
    t0 = time.perf_counter()
    prof = measure_spec_profile(model, (b,), progress=print, device="cpu", dtype="float32")
    print(f"profile measured in {time.perf_counter() - t0:.0f} s", flush=True)
    prompts = staggered(heldout_prompts(model, 2 * b, 256), phase_period(model))
    priced = [s * 1e3 for s in prof.uniform_seconds(b, 5)]
    runs: dict[str, list[float]] = {}
    for _ in range(2):
        for k in [0, *(int(x) for x in args.fixed.split(","))]:
            policy = "none" if k == 0 else f"fixed-{k}"
            r = _run(model, prompts, args.tokens, policy, None, {"device": "cpu", "dtype": "float32"}, 16, b)
            full = [row[0] for row, f in zip(r["_steps"], r["_full"]) if f]
            median = statistics.median(full) if full else float("nan")
            runs.setdefault(policy, []).append(median)
            print(f"{policy}: {median:.2f} ms a full-batch step ({len(full)} steps); profile {priced[k]:.2f}")
    print(json.dumps({"batch": b, "profile_uniform_ms": priced, "runs": runs}))


if __name__ == "__main__":
    main()
