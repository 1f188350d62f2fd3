"""Where DSpark's selection stopped, step by step, in one steady bench run.

One engine (the bench's `_run`, with `sluice bench spec --requests-per-slot 2`'s prompts) with
a DSpark policy scheduling by a step profile; for each decode step it prints the sequences
that decoded, the drafts they had, the drafts verified, and the survival (product of the
confidences) of the last draft admitted and of the first left out: the step's survival
threshold. Then the drafts verified per sequence over the steps of a full batch. A priced run
(the profile taken as it is) decides on its tokens only, so this repeats the bench's steps.

    .venv/bin/python scripts/spec_selection_steps.py \\
        --profile docs/data/spec_width_profile_h100_flash43.json --concurrency 128
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/trained")
    ap.add_argument("--profile", required=True, help="a step profile (sluice_spec_steps*.json)")
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--requests-per-slot", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompts-for", type=int, default=128, help="the bench's largest concurrency")
    args = ap.parse_args()

    import torch

    from engine.prompts import heldout_prompts, phase_period, staggered
    from services.bench.spec import _run

    torch.set_num_threads(1)
    model, c = Path(args.model), args.concurrency
    per_slot = args.requests_per_slot
    # the bench draws every concurrency's prompts from one list made for the largest
    prompts = staggered(heldout_prompts(model, args.prompts_for * per_slot, 256), phase_period(model))
    r = _run(
        model, prompts[: c * per_slot], args.tokens, "dspark", Path(args.profile),
        {"device": "cpu", "dtype": "float32"}, 16, concurrency=c, measured_costs=False,
    )  # fmt: skip
    print(f"policies chosen {r['policies_chosen']}")
    print("step sequences drafts verified last-admitted first-left-out")
    full = []
    for i, step in enumerate(r["_trace"]):
        admitted, left = [], []
        for conf, k, _ in step:
            surv = np.cumprod(conf)
            admitted += surv[:k].tolist()
            left += surv[k:].tolist()
        drafts, verified = sum(len(cf) for cf, _, _ in step), sum(k for _, k, _ in step)
        print(
            f"{i:4d} {len(step):9d} {drafts:6d} {verified:8d} "
            f"{min(admitted, default=float('nan')):13.3f} {max(left, default=float('nan')):14.3f}"
        )
        if len(step) == c:
            full.append(verified)
    if full:
        print(
            f"steps of {c} sequences: {len(full)}, drafts verified a sequence {sum(full) / (c * len(full)):.3f}"
        )


if __name__ == "__main__":
    main()
