"""`sluice bench spec`'s step profiles as report tables (`profile_table`, and back:
`profile_from_table`), and ``--width-profile`` / ``--width-from`` (`width_profile`): the step
profile of a preset's widths at the model's real depth, measured on a device at a few depths
and/or read from earlier reports, extrapolated by least squares."""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.spec.profile import SpecProfile, extrapolate_layers, fit_residuals  # pure: numpy, no torch
from services.bench import Report, progress


def profile_table(profile: SpecProfile, source: str) -> dict[str, Any]:
    """A `SpecProfile` as a report's table (with steps per second beside the seconds)."""
    return {
        "source": source,
        "batch": list(profile.batch),
        "drafts_verified": list(profile.drafts),
        "step_seconds": [list(r) for r in profile.seconds],
        "steps_per_s": [[1.0 / s for s in r] for r in profile.seconds],
        "drafted_per_step": profile.drafted,
        "draft_pass_seconds": list(profile.draft_pass),
        "plain_step_seconds": list(profile.plain),
        "first_verified_step_seconds": list(profile.first_verified),
        "meta": profile.meta,
    }


def profile_from_table(table: dict[str, Any], source: str) -> SpecProfile:
    """A `profile_table` back as the `SpecProfile` it was written from."""
    return SpecProfile(
        tuple(table["batch"]), tuple(table["drafts_verified"]),
        tuple(tuple(r) for r in table["step_seconds"]), int(table["drafted_per_step"]),
        tuple(table["draft_pass_seconds"]), tuple(table["plain_step_seconds"]),
        {**table.get("meta", {}), "read_from": source}, tuple(table.get("first_verified_step_seconds", ())),
    )  # fmt: skip


def device_name(device: str) -> str:
    """The GPU's model name, or ``cpu``."""
    if not device.startswith("cuda"):
        return "cpu"
    import torch

    return torch.cuda.get_device_name(torch.device(device))


def width_profile(args: argparse.Namespace, report: Report, engine_kwargs: dict[str, Any]) -> Report:
    """``--width-profile`` / ``--width-from``: the step profile at a preset's widths, measured
    at two or more depths (`engine.spec.profiling.measure_width_profiles`; and/or read from
    earlier reports) and extrapolated to the real one by least squares."""
    from engine.spec.profiling import measure_width_profiles

    t0 = time.perf_counter()
    pairs: list[tuple[int, SpecProfile]] = []
    # what measurements fitted together must share: the widths, and the EP size whose one
    # rank they time (1: the whole model on one device)
    presets: list[tuple[str, int]] = []
    devices: list[str] = []
    for path in [f for f in (args.width_from or "").split(",") if f.strip()]:
        earlier = json.loads(Path(path).read_text())
        presets.append((earlier["config"]["width_profile"], int(earlier["config"].get("width_ep", 1))))
        devices.append(earlier["results"]["profile"]["meta"].get("device", "?"))
        for key, table in earlier["results"].items():
            if m := re.fullmatch(r"measured_(\d+)_layers(_\d+)?", key):
                pairs.append((int(m.group(1)), profile_from_table(table, path)))
    if args.width_profile:
        depths = [int(x) for x in args.width_depths.split(",") if x.strip()]
        batches = [int(x) for x in args.width_batches.split(",") if x.strip()]
        with tempfile.TemporaryDirectory(prefix="sluice-width-profile-") as tmp:
            measured = measure_width_profiles(
                args.width_profile, depths, tmp, batches, prompt_tokens=args.prompt_tokens,
                steps=args.profile_steps, rounds=args.width_rounds, progress=progress, ep=args.width_ep,
                device=engine_kwargs["device"], dtype=engine_kwargs["dtype"],
            )  # fmt: skip
        pairs += sorted(measured.items())
        presets.append((args.width_profile, args.width_ep))
        devices.append(device_name(args.device))
    if len(set(presets)) != 1:
        raise SystemExit(
            "--width-from and --width-profile must be one preset's widths on one EP rank shape, not "
            f"{sorted(set(presets))}"
        )
    preset, ep = presets[0]
    pairs.sort(key=lambda dp: dp[0])  # stable: each depth's measurements in the order read
    profile = extrapolate_layers(pairs, args.width_layers)
    profile.meta.update(preset=preset, layers=args.width_layers, device=" + ".join(sorted(set(devices))))
    if ep > 1:
        profile.meta.update(ep=ep, exchange="not timed")
    report.config.update(
        width_profile=preset, width_ep=ep, depths=[d for d, _ in pairs], layers=args.width_layers,
        batches=list(profile.batch), width_from=args.width_from,
    )  # fmt: skip
    for i, (depth, p) in enumerate(pairs):  # a depth's n-th measurement: measured_<depth>_layers_<n>, n >= 2
        n = sum(1 for d, _ in pairs[: i + 1] if d == depth)
        key = f"measured_{depth}_layers" + (f"_{n}" if n > 1 else "")
        report.results[key] = profile_table(p, f"measured, {depth} decoder layers")
    report.results["fit_residuals"] = fit_residuals(pairs)
    report.results["profile"] = profile_table(profile, profile.meta["method"])
    if args.width_out:
        Path(args.width_out).write_text(profile.to_json() + "\n")
        report.results["saved_to"] = args.width_out
    for i, b in enumerate(profile.batch):
        row: dict[str, Any] = {"batch": b, "plain ms": round(profile.plain[i] * 1e3, 2)}
        row.update({f"k={k} ms": round(s * 1e3, 2) for k, s in enumerate(profile.seconds[i])})
        row["draft pass ms"] = round(profile.draft_pass[i] * 1e3, 2)
        if profile.first_verified:
            row["one draft verified ms"] = round(profile.first_verified[i] * 1e3, 2)
        report.rows.append(row)
    report.results["wall_s"] = round(time.perf_counter() - t0, 1)
    return report
