"""How much does one measurement move the V4-Flash-width profile's verdict? Leave one out.

The H100 profile at V4-Flash's widths is extrapolated to 43 layers from a few measurements at
depths 1-4 (`sluice bench spec --width-from`: each cell's least-squares line in depth), so a
measurement's noise is multiplied by ~10 in the cells DSpark trades against. This refits the
profile once per measurement with that one left out, then runs the steady-state bench at one
concurrency priced by each refit (and by the refit of all of them), with DSpark and the fixed
K it is judged against, and prints DSpark / fixed-5, DSpark / the best fixed K, and DSpark's
verified drafts and accepted length as shares of fixed-5's.

    .venv/bin/python scripts/spec_profile_loo.py --reports docs/data/bench_spec_width_h100_d1_3.json,\\
        docs/data/bench_spec_width_h100_d1_2_4.json,docs/data/bench_spec_width_h100_d2_3.json \\
        --concurrency 60 --json docs/data/spec_profile_loo_h100_c60.json --keep docs/data/spec_profile_loo_h100

About 1.5 min a profile on the 2-core VM (8 profiles: 12 min). The bench's prompts depend on
its largest concurrency, so figures at one concurrency alone differ a little from those of a
run over 32, 60 and 128.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MEASURED = re.compile(r"measured_(\d+)_layers(_\d+)?")


def refit(reports: list[tuple[str, dict]], out: Path, work: Path) -> None:
    """`sluice bench spec --width-from` over ``reports`` ((its file, the report as kept)), the
    profile to ``out``, whose measurements name the files they were read from."""
    paths = {}
    for i, (source, report) in enumerate(reports):
        if any(MEASURED.fullmatch(k) for k in report["results"]):
            path = work / f"{out.stem}_{i}.json"
            path.write_text(json.dumps(report))
            paths[str(path)] = source
    cmd = [
        sys.executable, "-m", "services.bench.spec", "--json", "--width-from", ",".join(paths),
        "--width-out", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    text = out.read_text()
    for written, source in paths.items():
        text = text.replace(json.dumps(written), json.dumps(source))
    out.write_text(text)


def priced_run(profile: Path, concurrency: int, policies: str) -> dict:
    """The steady-state bench at ``concurrency`` priced by ``profile``: its table row."""
    cmd = [
        sys.executable, "-m", "services.bench.spec", "--concurrency", str(concurrency), "--requests-per-slot", "2",
        "--policies", policies, "--repeats", "1", "--json", "--priced-by", str(profile),
    ]  # fmt: skip
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(done.stdout)["rows"][0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reports", required=True, help="comma-separated --width-profile --json reports")
    p.add_argument("--concurrency", type=int, default=60)
    p.add_argument("--fixed", default="fixed-4,fixed-5", help="the fixed policies DSpark is judged against")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--keep", type=Path, default=None, help="a folder: keep each refit's profile there")
    args = p.parse_args()
    files = [f for f in args.reports.split(",") if f.strip()]
    reports = [json.loads(Path(f).read_text()) for f in files]
    left_out: list[tuple[str, int, str] | None] = [None]  # None: every measurement kept
    left_out += [
        (f, i, k)
        for i, (f, r) in enumerate(zip(files, reports))
        for k in r["results"]
        if MEASURED.fullmatch(k)
    ]
    policies = f"{args.fixed},dspark"
    fixed = args.fixed.split(",")
    rows = []
    batches: list[int] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sluice-loo-") as tmp:
        work = Path(tmp)
        for n, out in enumerate(left_out):
            kept = copy.deepcopy(reports)
            if out is not None:
                del kept[out[1]]["results"][out[2]]
            name = "none" if out is None else f"{Path(out[0]).stem}:{out[2]}"
            profile = work / f"profile_{n}.json"
            if args.keep is not None:
                args.keep.mkdir(parents=True, exist_ok=True)
                profile = args.keep / (
                    "loo_all.json" if out is None else f"loo_without_{Path(out[0]).stem}_{out[2]}.json"
                )
            refit(list(zip(files, kept)), profile, work)
            fitted = json.loads(profile.read_text())
            seconds, batches = fitted["seconds"], fitted["batch"]
            row = priced_run(profile, args.concurrency, policies)
            tps = {pol: row[f"{pol} steady tok/s"] for pol in (*fixed, "dspark")}
            best = max(tps[f] for f in fixed)
            result = {
                "left_out": name,
                "steady_tok_s": tps,
                "dspark_over_fixed5": round(tps["dspark"] / tps["fixed-5"], 3),
                "dspark_over_best_fixed": round(tps["dspark"] / best, 3),
                "verified_share": round(
                    row["dspark steady verified/sequence"] / row["fixed-5 steady verified/sequence"], 3
                ),
                "accepted_length_share": round(
                    row["dspark steady acc len"] / row["fixed-5 steady acc len"], 3
                ),
                "profile_ms": [[round(s * 1e3, 1) for s in r] for r in seconds],
            }
            rows.append(result)
            print(
                f"[{time.monotonic() - t0:5.0f}s] left out {name}: DSpark / fixed-5 {result['dspark_over_fixed5']:.3f}, "
                f"/ best of {args.fixed} {result['dspark_over_best_fixed']:.3f}, verified {result['verified_share']:.3f} "
                f"at accepted length {result['accepted_length_share']:.3f} of fixed-5's",
                flush=True,
            )
    if args.json is not None:
        meta = {
            "reports": files,
            "concurrency": args.concurrency,
            "policies": policies,
            "requests_per_slot": 2,
            "profile_ms": f"per batch {batches}, the step verifying 0-5 of 5 drafts",
        }
        args.json.write_text(json.dumps({"config": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
