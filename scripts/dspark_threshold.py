"""Where DSpark's selection stops in DeepSeek's published cost regime, and what the shipped
confidence head keeps there.

DSpark admits a draft of survival ``a`` while ``a > c1 * E / s``: ``c1`` the seconds one more
verified token adds to a step, ``E`` the step's expected emitted tokens and ``s`` its seconds
(the marginal test of `engine.spec.dspark`, exact for an affine step time). DeepSeek's figures
for its production regime (per rank, 60 sequences) give two points of that step-time line:

* verifying all 5 drafts: 13,730 tok/s at an accepted length of 3.29 (60 x 6 tokens a step);
* DSpark: 14,466 tok/s at 3.20, verifying ``v`` drafts a request (3.2-4.4 published; "~30 %
  fewer" is 3.5): 60 x (1 + v) tokens a step.

The script prints the survival threshold for each ``v``, then, for every bench JSON given
(`sluice bench spec --json`, whose fixed-5 runs carry ``selection_replay``), the confidence
head's trade-off curve interpolated at those thresholds: the share of fixed-5's drafts it
verifies and of its accepted length it keeps.

    .venv/bin/python scripts/dspark_threshold.py docs/data/bench_spec_cpu_selection_replay.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

REQUESTS = 60
FIXED5 = (13_730.0, 3.29)  # tok/s per rank, accepted length, verifying all 5 drafts
DSPARK = (14_466.0, 3.20)  # tok/s per rank, accepted length, DSpark
VERIFIED = (3.2, 3.5, 4.4)  # drafts verified per request under DSpark: published range and "~30 %"


def threshold(v: float) -> tuple[float, float]:
    """(seconds per verified token, survival threshold) of the affine step time through the
    two published operating points, DSpark verifying ``v`` drafts a request."""
    s5 = REQUESTS * FIXED5[1] / FIXED5[0]
    sd = REQUESTS * DSPARK[1] / DSPARK[0]
    c1 = (s5 - sd) / (REQUESTS * (5 - v))
    return c1, c1 * REQUESTS * DSPARK[1] / sd


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bench_json", nargs="*", help="sluice bench spec --json outputs")
    args = p.parse_args()
    cuts = {v: threshold(v) for v in VERIFIED}
    for v, (c1, a) in cuts.items():
        print(f"v = {v}: {c1 * 1e6:.1f} us per verified token, survival threshold {a:.3f}")
    for path in args.bench_json:
        results = json.loads(Path(path).read_text())["results"]
        for key, cell in results.items():
            replay = cell.get("selection_replay") if isinstance(cell, dict) else None
            if not replay:
                continue
            curve = replay["tradeoff"]
            t = [q["threshold"] for q in curve]
            for v, (_, a) in cuts.items():
                ver = float(np.interp(a, t, [q["verified_share"] for q in curve]))
                acc = float(np.interp(a, t, [q["accepted_length_share"] for q in curve]))
                print(f"{path} {key}, v = {v}: verified {ver:.3f}, accepted length {acc:.3f} of fixed-5's")


if __name__ == "__main__":
    main()
