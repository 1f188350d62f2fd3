"""`sluice bench spec` with the profile read as before 2026-12-07: `SpecProfile.for_batch`'s
tables made monotone by a running maximum (now the least-squares fit, `monotone_fit`), and
the uniform depths' prices (`SpecProfile.uniform_seconds`) as measured (now fitted too). The
before-side of that change, on the same code otherwise.

    .venv/bin/python scripts/spec_bench_running_max.py --concurrency 60,128 ... --json
"""

from __future__ import annotations

import sys

import numpy as np

import engine.spec.profile as profile
from services.bench.spec import main


def uniform_as_measured(self: profile.SpecProfile, batch: int, drafts: int) -> tuple[float, ...]:
    return tuple(self.step_seconds(batch, k, k) for k in range(drafts + 1))


profile.monotone_fit = lambda values: [float(v) for v in np.maximum.accumulate(list(values))]
profile.SpecProfile.uniform_seconds = uniform_as_measured  # type: ignore[method-assign]

if __name__ == "__main__":
    main(sys.argv[1:])
