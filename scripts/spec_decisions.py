"""What DSpark's drafting depth rested on, step by step, in one bench run.

One engine (the bench's `_run`) on the trained preset with a DSpark policy; after each step
that had drafts the policy's `view` is recorded (`SpecPolicy.decisions`): its mode and
depth, the requests' steps with drafts seen, each option's averaged value over plain
decoding's, and per draft position the observed rate, the head's recalibration and its
mean prediction. Prints the steps where the mode changed (and the first and last few),
then the whole record as one JSON line. The profile is taken as it is (no measured costs),
so a run's decisions depend on its tokens only.

    .venv/bin/python scripts/spec_decisions.py --profile docs/data/spec_profile_h100_drafter.json \\
        --concurrency 1 --requests-per-slot 6 --tokens 128 --warmup-tokens 128
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/trained")
    ap.add_argument("--profile", required=True, help="a step profile (sluice_spec_steps*.json)")
    ap.add_argument("--policy", default="dspark", choices=("dspark", "dspark-lagged"))
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--requests-per-slot", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--finish-spread", type=int, default=1)
    ap.add_argument("--warmup-tokens", type=int, default=16)
    args = ap.parse_args()

    import torch

    from engine.prompts import heldout_prompts, phase_period, staggered
    from services.bench.spec import _run

    torch.set_num_threads(1)
    record: list[dict] = []
    model, c = Path(args.model), args.concurrency
    prompts = staggered(heldout_prompts(model, c * args.requests_per_slot, 256), phase_period(model))
    r = _run(
        model, prompts, args.tokens, args.policy, Path(args.profile), {"device": "cpu", "dtype": "float32"},
        args.warmup_tokens, concurrency=c, measured_costs=False, finish_spread=args.finish_spread,
        decisions=record,
    )  # fmt: skip
    print(f"policies chosen {r['policies_chosen']}, accepted length {r['accepted_length']:.2f}")
    for i, v in enumerate(record):
        if i < 3 or i >= len(record) - 3 or v["mode"] != record[i - 1]["mode"]:
            print(i, v["mode"], v["depth"], f"b={v['batch']} seen={v['seen']}", v["values"], v["calibration"])
    print(json.dumps(record))


if __name__ == "__main__":
    main()
