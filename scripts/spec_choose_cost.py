"""Host time of one speculation policy's per-step choice (`SpecPolicy.choose`), by batch size.

Each step hands the policy seeded synthetic confidences (uniform in [0.5, 1)) for every
request's 5 drafts and then the outcomes it would observe (a uniform number of the verified
drafts accepted); the drafting depth is put back to 5 whenever the policy switches
speculation off, so that every timed step is a speculating one. Prints the mean per step.
This is the cost `sluice bench spec` reports per run as `choose_ms_per_step`, without an
engine: on a GPU it is host time the device waits for in a synchronous step.

    .venv/bin/python scripts/spec_choose_cost.py --profile models/trained/sluice_spec_steps_h100.json
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from engine.spec.config import SpecConfig
from engine.spec.policy import SpecPolicy
from engine.spec.profile import SpecProfile


def mean_choose_ms(policy: str, profile: SpecProfile, batch: int, steps: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    spec = SpecPolicy(SpecConfig.parse(policy), profile)
    rids = [f"r{i}" for i in range(batch)]
    total = 0.0
    for _ in range(steps):
        spec.depth = spec.depth or 5
        conf = (0.5 + 0.5 * rng.random((batch, 5))).tolist()
        t0 = time.perf_counter()
        ks, _ = spec.choose(rids, conf)
        total += time.perf_counter() - t0
        for rid, k in zip(rids, ks):
            spec.observe(rid, int(rng.integers(0, k + 1)))
    return total / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True, help="a step profile (sluice_spec_steps*.json)")
    ap.add_argument("--policies", default="fixed-5,dspark")
    ap.add_argument("--batches", default="1,8,32,60,128")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    profile = SpecProfile.load(args.profile)
    policies = args.policies.split(",")
    print("batch | " + " | ".join(f"{p} ms" for p in policies))
    for b in (int(x) for x in args.batches.split(",")):
        cells = [mean_choose_ms(p, profile, b, args.steps, args.seed) for p in policies]
        print(f"{b} | " + " | ".join(f"{c:.3f}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
