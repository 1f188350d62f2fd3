"""`sluice bench spec`'s report: a concurrency's table row and the issue's targets, declared
in the JSON (``Report.target``)."""

from __future__ import annotations

from typing import Any

from services.bench import Report
from services.bench._spec_replay import TARGET_VERIFIED_SHARE


def table_row(
    c: int, runs: dict[str, dict[str, Any]], extra: dict[str, Any], judged: str = "tokens_per_s"
) -> dict[str, Any]:
    """The table's row of one concurrency (``judged``: the throughput the targets read)."""
    row: dict[str, Any] = {"concurrency": c}
    for policy, r in runs.items():
        row[f"{policy} tok/s"] = round(r["tokens_per_s"], 1)
    if judged != "tokens_per_s":
        for policy, r in runs.items():
            row[f"{policy} steady tok/s"] = round(r[judged], 1)
        for policy, r in runs.items():  # steps that also ran refills' prompts
            row[f"{policy} steady prompt steps"] = r["steady_prompt_steps"]
        steady = best_ratio(runs, judged)
        if steady is not None:
            row["dspark / best, steady"] = round(steady, 3)
        decode = best_ratio(runs, "steady_decode_tokens_per_s")
        if decode is not None:  # the same over the steps without refills' prompts
            row["dspark / best, steady decode steps"] = round(decode, 3)
    full = best_ratio(runs, "full_batch_tokens_per_s")
    if full is not None:  # the same comparison over the steps of all c requests (no drain)
        row["dspark / best, full batch"] = round(full, 3)
    for policy in ("dspark", "fixed-5"):
        r = runs.get(policy, {})
        row[f"{policy} verified/step"] = round(r.get("verified_per_step", 0.0), 2)
        row[f"{policy} verified/sequence"] = round(r.get("verified_per_sequence", 0.0), 3)
        if judged != "tokens_per_s":
            row[f"{policy} steady verified/sequence"] = round(r.get("steady_verified_per_sequence", 0.0), 3)
            row[f"{policy} steady acc len"] = round(r.get("steady_accepted_length", 0.0), 3)
    row["dspark acc len"] = round(runs.get("dspark", {}).get("accepted_length", 0.0), 3)
    row["fixed-5 acc len"] = round(runs.get("fixed-5", {}).get("accepted_length", 0.0), 3)
    if extra:
        row["oracle tok/s (modelled)"] = round(extra["modelled_oracle_tokens_per_s"], 1)
        replay = extra["selection_replay"]
        if replay:  # the head's ranking at the selection targets' point (replayed)
            row["acc len share at 0.75 verified"] = round(
                replay[f"accepted_length_share_at_{TARGET_VERIFIED_SHARE}"], 3
            )
    return row


#: the notes of targets that a DSpark run with speculation off on every step grades
OFF_NOTE = (
    "dspark turned speculation off on every timed step and did plain decoding's work: this "
    "compares two runs of plain decoding, so it grades the runs' spread, not the selection"
)
OFF_BOX_NOTE = "dspark turned speculation off on every timed step: nothing verified, nothing selected"


def speculation_off(run: dict[str, Any]) -> bool:
    """Whether a DSpark run neither drafted nor verified on any timed step (every step's
    policy ``off``)."""
    chosen = run.get("policies_chosen") or {}
    return bool(chosen) and set(chosen) == {"off"}


def best_ratio(runs: dict[str, dict[str, Any]], key: str) -> float | None:
    """DSpark's ``key`` throughput over the best of plain decoding's and fixed-K's."""
    ds = runs.get("dspark")
    best = max((r[key] for p, r in runs.items() if p == "none" or p.startswith("fixed-")), default=0.0)
    if ds is None or not best or not ds[key]:
        return None
    return float(ds[key] / best)


def declare_targets(
    report: Report, c: int, runs: dict[str, dict[str, Any]], judged: str = "tokens_per_s"
) -> None:
    """The issue's targets at concurrency ``c``; the throughput ones read ``judged`` (whole runs,
    or the steady steps of a run whose slots are refilled)."""
    ds, f5 = runs.get("dspark"), runs.get("fixed-5")
    if ds is None:
        return
    off = speculation_off(ds)
    baselines = [r[judged] for p, r in runs.items() if p == "none" or p.startswith("fixed-")]
    if baselines:
        report.target(
            f"c={c}: dspark / best of none and fixed-1..5", ds[judged] / max(baselines), ">=", 0.98,
            note=OFF_NOTE if off and max(baselines) == runs.get("none", {}).get(judged) else None,
        )  # fmt: skip
    if f5 is None:
        return
    # the selection targets read the window the throughput ones do: a steady run's refilled
    # steps (at concurrency c), not its drain
    window, at = ("steady_", ", steady") if judged == "steady_tokens_per_s" else ("", "")
    verified, length = f"{window}verified_per_sequence", f"{window}accepted_length"
    if c >= 32 and f5[verified]:
        report.target(
            f"c={c}: dspark verified / fixed-5 verified, per sequence{at}",
            ds[verified] / f5[verified],
            "<=",
            TARGET_VERIFIED_SHARE,
            note=OFF_BOX_NOTE if off else None,
        )
        report.target(
            f"c={c}: dspark accepted length / fixed-5's{at}",
            ds[length] / f5[length],
            ">=",
            0.97,
            note=OFF_BOX_NOTE if off else None,
        )
    if c == 60 and f5[judged]:
        report.target("c=60: dspark / fixed-5 throughput", ds[judged] / f5[judged], ">=", 1.04)
