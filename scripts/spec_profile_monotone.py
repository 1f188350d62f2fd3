"""How far a step profile's cells are from monotone, and what the two fits price them at.

For each profile file and batch size, the step times of verifying 0-5 drafts (drafting the
profile's depth: `SpecProfile.step_seconds`), then the table DSpark prices a selection with
(`SpecProfile.for_batch`: the least-squares non-decreasing fit, `monotone_fit`) and what the
running maximum used before would have made of the same cells. Rows already monotone are
counted, not printed.

    .venv/bin/python scripts/spec_profile_monotone.py models/trained/sluice_spec_steps_h100.json \\
        models/trained/sluice_spec_steps_h200.json docs/data/spec_width_profile_h100_flash43.json
"""

from __future__ import annotations

import argparse

import numpy as np

from engine.spec.profile import SpecProfile


def ms(values) -> str:
    return " ".join(f"{1e3 * v:7.2f}" for v in values)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("profiles", nargs="+", help="sluice_spec_steps*.json files")
    args = p.parse_args()
    for path in args.profiles:
        profile = SpecProfile.load(path)
        out_of_order = 0
        for b in profile.batch:
            cells = [profile.step_seconds(b, k) for k in profile.drafts]
            if all(y >= x for x, y in zip(cells, cells[1:])):
                continue
            out_of_order += 1
            fitted = [1.0 / r for r in profile.for_batch(b).rates]
            if len(fitted) > len(cells):  # the first-verified point sits at batch + 1 tokens
                fitted = fitted[:1] + fitted[2:]
            print(f"{path} batch {b}, ms at 0-5 drafts verified")
            print(f"  measured        {ms(cells)}")
            print(f"  least squares   {ms(fitted)}")
            print(f"  running maximum {ms(np.maximum.accumulate(cells))}")
        print(f"{path}: {out_of_order} of {len(profile.batch)} rows out of order")


if __name__ == "__main__":
    main()
