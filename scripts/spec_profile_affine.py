"""A what-if step profile: each batch row's steps verifying 1-5 drafts replaced by their
least-squares line in the drafts verified (the slope floored at 0), the step verifying none
kept as measured.

A measured profile can price a step of more drafts below one of fewer (the H100's
V4-Flash-width profile does so at 64 and 128 requests, 4 drafts below 3, extrapolated to 43
layers from measurements of depths 1-4 that disagree by more than that), and its monotone fit (`engine.spec.step_table.monotone_fit`) then makes the
next draft free, so the selection stops at the kink after it. This profile asks where the
selection would stop on a card where, past the first verified draft, each draft cost the same:
the regime of a step whose experts are all read anyway (64 requests and more at V4-Flash's
widths on one card). It is not what the engine ships; `sluice bench spec --priced-by` on it
prices a what-if.

    .venv/bin/python scripts/spec_profile_affine.py docs/data/spec_width_profile_h100_flash43.json \\
        docs/data/spec_width_profile_h100_flash43_affine_whatif.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def affine_row(row: list[float]) -> list[float]:
    """``row[0]`` as it is, ``row[1:]`` by their least-squares line (slope >= 0)."""
    v = np.arange(1, len(row), dtype=np.float64)
    y = np.asarray(row[1:], dtype=np.float64)
    slope, intercept = np.polyfit(v, y, 1)
    if slope < 0:
        slope, intercept = 0.0, float(y.mean())
    return [row[0], *(intercept + slope * v).tolist()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("profile", type=Path, help="a sluice_spec_steps*.json file")
    p.add_argument("out", type=Path, help="the what-if profile's JSON file")
    args = p.parse_args()
    d = json.loads(args.profile.read_text())
    rows = [affine_row(row) for row in d["seconds"]]
    for b, row, fit in zip(d["batch"], d["seconds"], rows):
        print(
            f"{b:4d} "
            + " ".join(f"{1e3 * x:6.1f}" for x in row)
            + "  ->  "
            + " ".join(f"{1e3 * x:6.1f}" for x in fit)
        )
    d["seconds"] = rows
    d["meta"] = {**d.get("meta", {}), "what_if": f"{args.profile}: verifying 1-5 drafts affine per batch row"}
    args.out.write_text(json.dumps(d, indent=1) + "\n")


if __name__ == "__main__":
    main()
