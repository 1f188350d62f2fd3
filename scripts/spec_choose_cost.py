"""Host time of one speculation policy's per-step choice (`SpecPolicy.choose`), by batch size.

Each step hands the policy seeded synthetic confidences (uniform in [0.5, 1)) for every
request's 5 drafts and then the outcomes it would observe (a uniform number of the verified
drafts accepted); the drafting depth is put back to 5 whenever the policy switches
speculation off, so that every timed step is a speculating one. Prints the mean per step.
This is the cost `sluice bench spec` reports per run as `choose_ms_per_step`, without an
engine: on a GPU it is host time the device waits for in a synchronous step.

``--as-chosen`` drafts each step as deep as the policy chose (none while it is off, when the
step takes the policy's path without drafts), as an engine's steps do, with the policy's clock
fixed at 25 us a choice (it prices its own host time, so a real clock would make its
decisions, and the steps timed, differ from run to run and machine to machine).

``--off`` times instead the steps of a DSpark policy that has switched speculation off (after
enough steps with drafts to decide): the policy's whole host work of such a step, its
choice (`SpecPolicy.idle`) and its step timing (`SpecPolicy.observe_seconds`), which a
speculating engine pays beyond a plain one's while speculation does not pay.

    .venv/bin/python scripts/spec_choose_cost.py --profile models/trained/sluice_spec_steps_h100.json
    .venv/bin/python scripts/spec_choose_cost.py --profile models/trained/sluice_spec_steps_h100.json --off
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from engine.spec.config import SpecConfig
from engine.spec.policy import SpecPolicy
from engine.spec.profile import SpecProfile


def mean_choose_ms(
    policy: str, profile: SpecProfile, batch: int, steps: int, seed: int, as_chosen: bool = False
) -> float:
    rng = np.random.default_rng(seed)
    spec = SpecPolicy(SpecConfig.parse(policy), profile)
    if as_chosen:  # every choice "takes" 25 us: the same decisions on every machine and run
        ticks = iter(range(1 << 62))
        spec.clock = lambda: next(ticks) * 25e-6
    rids = [f"r{i}" for i in range(batch)]
    total = 0.0
    for _ in range(steps):
        if not as_chosen:
            spec.depth = spec.depth or 5
        conf = (0.5 + 0.5 * rng.random((batch, spec.depth))).tolist()
        t0 = time.perf_counter()
        ks, _ = spec.choose(rids, conf)
        total += time.perf_counter() - t0
        for rid, k in zip(rids, ks):
            spec.observe(rid, int(rng.integers(0, k + 1)))
    return total / steps * 1e3


def mean_off_step_us(profile: SpecProfile, batch: int, steps: int, seed: int) -> float:
    """Microseconds of host work a step while DSpark is off (its choice and its timing)."""
    rng = np.random.default_rng(seed)
    spec = SpecPolicy(SpecConfig.parse("dspark"), profile)
    rids = [f"r{i}" for i in range(batch)]
    while spec.drafting.seen < spec.MIN_EVIDENCE:  # evidence first: the depth decides
        spec.depth = 5
        ks, _ = spec.choose(rids, (0.5 + 0.5 * rng.random((batch, 5))).tolist())
        for rid, k in zip(rids, ks):
            spec.observe(rid, int(rng.integers(0, k + 1)))
    spec.mode, spec.depth = "off", 0
    plain = profile.step_seconds(batch, 0, 0)
    total = 0.0
    for i in range(steps):
        t0 = time.perf_counter()
        spec.idle(batch)
        spec.observe_seconds(plain * (1.0 + 0.01 * (i % 7)))
        total += time.perf_counter() - t0
    return total / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True, help="a step profile (sluice_spec_steps*.json)")
    ap.add_argument("--policies", default="fixed-5,dspark")
    ap.add_argument("--batches", default="1,8,32,60,128")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--off", action="store_true", help="time DSpark's steps while speculation is off")
    ap.add_argument(
        "--as-chosen", action="store_true",
        help="each step drafts as deep as the policy chose (none while off) instead of 5, on a fixed clock",
    )  # fmt: skip
    args = ap.parse_args()
    profile = SpecProfile.load(args.profile)
    if args.off:
        print("batch | dspark off: us a step")
        for b in (int(x) for x in args.batches.split(",")):
            print(f"{b} | {mean_off_step_us(profile, b, args.steps * 10, args.seed):.1f}", flush=True)
        return
    policies = args.policies.split(",")
    print("batch | " + " | ".join(f"{p} ms" for p in policies))
    for b in (int(x) for x in args.batches.split(",")):
        cells = [mean_choose_ms(p, profile, b, args.steps, args.seed, args.as_chosen) for p in policies]
        print(f"{b} | " + " | ".join(f"{c:.3f}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
