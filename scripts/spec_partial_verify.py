"""What a speculating step costs when its requests verify different numbers of drafts.

The step profile (`engine.spec.profile.SpecProfile`) is measured with every request of a
step verifying the same ``k`` drafts, and DSpark's selection is priced by interpolating it
in the step's total tokens (`SpecProfile.for_batch`). This measures steps that are not on
those points: the first ``m`` of ``B`` requests verify ``K`` drafts, the others none (every
request drafting 5): the profile's own cell (`engine.spec.profiling._cell`, the ``fixed-K:5``
policy limited to the first ``m`` requests by `SpecPolicy.verifying_requests`), the median of
24 such steps after 6, in fresh engines, the smallest of ``--rounds``.
Beside each, the price a profile measured in the same run (`measure_spec_profile`, this
batch size alone) gives that step, interpolated between its uniform points alone, and with
its step verifying one draft (``first_verified``).

    .venv/bin/python scripts/spec_partial_verify.py --batch 16        # ~5 min on the 2-core VM
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/trained")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import torch

    from engine.spec.profiling import _cell, _prompts, release_memory

    torch.set_num_threads(1)
    b = args.batch
    prompts, _ = _prompts(Path(args.model), b, 256, 0)
    patterns = [(1, 0), (1, 1), (1, 2), (1, b // 4), (1, b // 2), (1, b), (2, b), (5, 1), (5, b // 4), (5, b)]
    cells: dict[tuple[int, int], list[float]] = {}
    for _ in range(args.rounds):
        for k, m in patterns:
            seconds = _cell(Path(args.model), b, k, 5, prompts, 6, 24, {"device": args.device}, verifying=m)
            release_memory({"device": args.device})
            cells.setdefault((k, m), []).append(seconds)
    from dataclasses import replace

    from engine.spec.profiling import measure_spec_profile

    profile = measure_spec_profile(args.model, batches=(b,), rounds=args.rounds, device=args.device)
    with_point, without = profile.for_batch(b), replace(profile, first_verified=()).for_batch(b)
    rows = [
        {
            "drafts": k,
            "requests": m,
            "verified": k * m,
            "ms": min(v) * 1e3,
            "rounds_ms": [x * 1e3 for x in v],
            "priced_ms_uniform_points": without.seconds(b + k * m) * 1e3,
            "priced_ms_with_first_verified": with_point.seconds(b + k * m) * 1e3,
        }  # fmt: skip
        for (k, m), v in cells.items()
    ]
    if args.json:
        out = {"batch": b, "device": args.device, "rows": rows, "profile": json.loads(profile.to_json())}
        print(json.dumps(out, indent=1))
        return
    print(f"batch {b}: the first m requests verify K drafts, the rest none (all draft 5); priced by")
    print("the profile's uniform points alone, and with its step verifying one draft")
    for r in rows:
        print(
            f"K={r['drafts']} m={r['requests']:3d} verified={r['verified']:3d}: {r['ms']:6.1f} ms, priced "
            f"{r['priced_ms_uniform_points']:6.1f} / {r['priced_ms_with_first_verified']:6.1f} ms"
        )


if __name__ == "__main__":
    main()
