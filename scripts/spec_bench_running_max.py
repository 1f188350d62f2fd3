"""`sluice bench spec` with the profile made monotone by a running maximum, as
`SpecProfile.for_batch` did before it took the least-squares fit (`monotone_fit`): the
before-side of that change, on the same code otherwise.

    .venv/bin/python scripts/spec_bench_running_max.py --concurrency 60,128 ... --json
"""

from __future__ import annotations

import sys

import numpy as np

import engine.spec.profile as profile
from services.bench.spec import main

profile.monotone_fit = lambda values: [float(v) for v in np.maximum.accumulate(list(values))]

if __name__ == "__main__":
    main(sys.argv[1:])
