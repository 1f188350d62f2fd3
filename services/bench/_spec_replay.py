"""`sluice bench spec`'s replays of recorded decode steps: pure functions over a run's trace
(per step, per request: the draft confidences, the drafts verified, the drafts accepted).

* ``acceptance``: per-position acceptance of a fixed-5 trace;
* ``modelled``: what a step profile predicts for the oracle, fixed-5 and DSpark on it;
* ``priced_window``: a run's decode tokens per second over chosen steps, each step priced
  by another profile; ``window_per_sequence``: its verified drafts and accepted length
  per sequence over chosen steps;
* ``selection_replay``: the confidence head's trade-off curve and DSpark's speculating
  selection priced by each profile (`services.bench.spec`'s module doc says why).
"""

from __future__ import annotations

from typing import Any

import numpy as np

Trace = list[list[tuple[tuple[float, ...], int, int]]]  # per step: (confidences, verified, accepted)

#: survival thresholds of the confidence head's trade-off curve (`selection_replay`)
TRADEOFF_THRESHOLDS = (0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
#: the verified share at which the selection targets ask for the accepted length (c >= 32)
TARGET_VERIFIED_SHARE = 0.75


def acceptance(trace: Trace, depth: int = 5) -> list[float]:
    """P(draft j accepted | drafts 1..j-1 accepted) over a fixed-5 trace."""
    reach = [0] * depth
    hit = [0] * depth
    for step in trace:
        for _, k, acc in step:
            for j in range(min(k, depth)):
                reach[j] += 1
                if acc > j:
                    hit[j] += 1
                else:
                    break
    return [h / r if r else 0.0 for h, r in zip(hit, reach)]


def window_per_sequence(trace: Trace, decoders: list[int], mask: list[bool]) -> tuple[float, float]:
    """(drafts verified, accepted length) per sequence per step over the decoding steps where
    ``mask`` holds (``decoders``: per step, the requests that decoded; a step without any
    records no trace step, as in `priced_window`)."""
    n = verified = accepted = 0
    steps = (m for m, d in zip(mask, decoders) if d)
    for m, step in zip(steps, trace):
        if m:
            n += len(step)
            verified += sum(k for _, k, _ in step)
            accepted += sum(acc for _, _, acc in step)
    return (verified / n, 1.0 + accepted / n) if n else (0.0, 1.0)


def _verified_rows(trace: Trace) -> list[tuple[list[float], int]]:
    """(confidences, accepted drafts) of every request-step of a fixed-5 trace that drafted."""
    return [(list(cf), acc) for step in trace for cf, k, acc in step if k]


def modelled(trace: Trace, profile: Any, c: int) -> dict[str, float]:
    """Throughput the profile predicts on the fixed-5 trace for the oracle, fixed-5 and DSpark."""
    from engine.spec.dspark import select_dspark

    out = {"oracle": 0.0, "fixed-5": 0.0, "dspark": 0.0}
    secs = dict.fromkeys(out, 0.0)
    for step in trace:
        if not step:
            continue
        table = profile.for_batch(len(step))
        L = [acc for _, k, acc in step if k]  # the fixed-5 trace verifies every draft it has
        conf = [list(cf) for cf, k, _ in step if k]
        if not L:
            continue
        choices = {
            "oracle": L,
            "fixed-5": [len(cf) for cf in conf],
            "dspark": select_dspark(conf, table),
        }
        for name, ks in choices.items():
            out[name] += sum(1 + min(k, acc) for k, acc in zip(ks, L))
            secs[name] += float(table.seconds(sum(k + 1 for k in ks)))
    return {f"modelled_{k}_tokens_per_s": (out[k] / secs[k] if secs[k] else 0.0) for k in out}


def _priced_step(step: list[Any], profile: Any) -> float:
    """One traced step at its batch, verified drafts and drafting depth (none drafted: plain)."""
    if not step:
        return 0.0
    drafted = max(len(cf) for cf, _, _ in step)
    if drafted == 0:
        return profile.step_seconds(len(step), 0, 0)
    return float(profile.for_batch(len(step), drafted).seconds(sum(k + 1 for _, k, _ in step)))


def priced_window(run: dict[str, Any], trace: Trace | None, profile: Any, mask: list[bool]) -> float:
    """Decode tokens per priced second over the run's steps where ``mask`` holds.

    ``_step_tokens``: each step's decode tokens; ``_decoders`` (when present): how many
    requests decoded in it, else every step decoded all ``concurrency``. A step in which
    nobody decodes (only prompts: a steady run's refill after every request finished at once)
    records no trace step and is priced at 0: a prefill pool runs prompts, and the profile
    prices decode steps. Traced steps are priced at their batch, verified drafts and depth,
    untraced ones (no speculation) as plain steps of their decoders."""
    tokens = run["_step_tokens"]
    decoders = run.get("_decoders") or [run["concurrency"]] * len(tokens)
    if not len(mask) == len(tokens) == len(decoders):
        raise ValueError("the mask, _step_tokens and _decoders must have one entry per step")
    decoding = sum(1 for d in decoders if d)
    if trace and len(trace) != decoding:
        raise ValueError(
            f"the trace has {len(trace)} steps, the run {decoding} decoding steps: they must align"
        )
    emitted = seconds = 0.0
    traced = 0
    for m, n, d in zip(mask, tokens, decoders):
        if not d:
            continue
        step = trace[traced] if trace else None
        traced += 1
        if m:
            emitted += n
            seconds += _priced_step(step, profile) if step is not None else profile.step_seconds(d, 0, 0)
    return emitted / seconds if seconds else 0.0


def shares(rows: list[tuple[list[float], int]], ks: list[int]) -> dict[str, float]:
    """Verified drafts and accepted length of choice ``ks``, each as a share of fixed-5's."""
    n = len(rows)
    drafted = sum(len(cf) for cf, _ in rows)
    accepted = sum(acc for _, acc in rows)
    kept = sum(min(k, acc) for k, (_, acc) in zip(ks, rows))
    return {
        "verified_share": sum(ks) / drafted if drafted else 0.0,
        "accepted_length": 1.0 + kept / n if n else 1.0,
        "accepted_length_share": (n + kept) / (n + accepted) if n else 1.0,
    }


def selection_replay(trace: Trace, profiles: dict[str, Any]) -> dict[str, Any]:
    """DSpark's selection within speculation, replayed on the fixed-5 trace (every draft
    verified, so each request-step's confidences and accepted drafts ``L`` are known; a
    choice of ``k`` drafts accepts ``min(k, L)``).

    * ``tradeoff``: the confidence head's ranking alone. Each request verifies the drafts
      whose survival (product of confidences) exceeds a threshold; per threshold, the verified
      drafts and the accepted length as shares of fixed-5's. ``accepted_length_share_at_0.75``
      interpolates it where 25 % fewer drafts are verified (the c >= 32 target's point).
    * ``speculating``: DSpark's selection with speculation kept on at depth 5 (DeepSeek's
      production setting; the engine's policy may instead turn speculation off), priced by
      each profile: where its throughput-optimal prefix lands on that curve.
    """
    from engine.spec.dspark import select_dspark, survival

    rows = _verified_rows(trace)
    if not rows:
        return {}
    surv = [survival(cf) for cf, _ in rows]
    curve = [
        {"threshold": t, **shares(rows, [int((a > t).sum()) for a in surv])} for t in TRADEOFF_THRESHOLDS
    ]
    by_share = sorted(curve, key=lambda p: p["verified_share"])
    at_target = float(
        np.interp(TARGET_VERIFIED_SHARE, [p["verified_share"] for p in by_share],
                  [p["accepted_length_share"] for p in by_share])
    )  # fmt: skip
    speculating: dict[str, dict[str, float]] = {}
    for name, profile in profiles.items():
        ks: list[int] = []
        for step in trace:
            conf = [list(cf) for cf, k, _ in step if k]
            if conf:
                ks += select_dspark(conf, profile.for_batch(len(step)))
        speculating[name] = shares(rows, ks)
    return {
        "tradeoff": curve,
        f"accepted_length_share_at_{TARGET_VERIFIED_SHARE}": at_target,
        "speculating": speculating,
    }
