"""The trace side of ``sluice bench e2e``: Mooncake rows scaled into requests with real
prompts (one token run per 512-token hash block, so shared blocks share tokens), and the
latency summaries of a replay. Pure: no engine, no Ray."""

from __future__ import annotations

import json
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TRACE_BLOCK_TOKENS = 512  # Mooncake hash_ids: one id per 512-token block
TOKEN_LOW, TOKEN_HIGH = 10, 1000  # prompt token ids, clear of the special tokens


@dataclass(frozen=True)
class TraceRequest:
    index: int
    arrival_s: float  # scaled
    prompt: tuple[int, ...]
    max_tokens: int
    trace_input: int
    trace_output: int
    hash_ids: tuple[int, ...]


def scaled_block(scale: float) -> int:
    return max(1, round(TRACE_BLOCK_TOKENS * scale))


def block_run(hash_id: int, n: int, salt: str, vocab: int) -> list[int]:
    """The fixed run of ``n`` token ids hash block ``hash_id`` stands for."""
    rng = random.Random(f"e2e:{salt}:{hash_id}")
    high = min(TOKEN_HIGH, vocab)
    return [rng.randrange(TOKEN_LOW, high) for _ in range(n)]


def build_prompt(
    hash_ids: Sequence[int], n_tokens: int, block: int, salt: str, vocab: int
) -> tuple[int, ...]:
    """Full block runs for every hash id, cut to ``n_tokens`` (the last block partial)."""
    out: list[int] = []
    for h in hash_ids:
        if len(out) >= n_tokens:
            break
        out += block_run(h, block, salt, vocab)
    return tuple(out[:n_tokens])


def load_trace(path: Path, n: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with path.open() as f:
        for line in f:
            if len(rows) >= n:
                break
            if line.strip():
                rows.append(json.loads(line))
    if len(rows) < n:
        raise ValueError(f"{path} holds {len(rows)} requests, --requests asks for {n}")
    return rows


def scale_trace(
    rows: Sequence[dict[str, Any]], scale: float, time_scale: float, context: int, salt: str, vocab: int
) -> list[TraceRequest]:
    """The replay's requests: tokens scaled by ``scale`` (outputs at least 2), arrivals by
    ``time_scale`` (relative to the first), prompts trimmed so prompt + output fit ``context``."""
    block = scaled_block(scale)
    t_first = min(float(r["timestamp"]) for r in rows)
    out = []
    for i, r in enumerate(rows):
        hash_ids = tuple(int(h) for h in r["hash_ids"])
        n_out = max(2, round(int(r["output_length"]) * scale))
        n_in = max(1, round(int(r["input_length"]) * scale))
        n_in = min(n_in, len(hash_ids) * block, context - n_out - 1)
        out.append(
            TraceRequest(
                index=i,
                arrival_s=(float(r["timestamp"]) - t_first) / 1000.0 * time_scale,
                prompt=build_prompt(hash_ids, n_in, block, salt, vocab),
                max_tokens=n_out,
                trace_input=int(r["input_length"]),
                trace_output=int(r["output_length"]),
                hash_ids=hash_ids,
            )
        )
    return out


def pct(values: Sequence[float], q: float) -> float:
    """Percentile ``q`` in [0, 1] with linear interpolation; nan when empty."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class Timing:
    """One request's token times (``time.perf_counter``), one per token."""

    request_id: str
    prompt_tokens: int
    submit: float = 0.0
    token_times: list[float] = field(default_factory=list)
    busy_retries: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.submit if self.token_times else math.nan

    @property
    def t2(self) -> float:
        return self.token_times[1] - self.token_times[0] if len(self.token_times) > 1 else math.nan

    @property
    def tpot(self) -> float:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else math.nan

    @property
    def done(self) -> float:
        return self.token_times[-1] if self.token_times else math.nan


def latency_summary(timings: Sequence[Timing]) -> dict[str, Any]:
    ok = [t for t in timings if t.error is None]
    out: dict[str, Any] = {"requests": len(timings), "completed": len(ok), "failed": len(timings) - len(ok)}
    for key in ("ttft", "t2", "tpot"):
        xs = [getattr(t, key) for t in ok if not math.isnan(getattr(t, key))]
        out[f"{key}_s"] = {
            "p50": pct(xs, 0.5),
            "p99": pct(xs, 0.99),
            "mean": statistics.fmean(xs) if xs else math.nan,
        }
    out["output_tokens"] = sum(len(t.token_times) for t in ok)
    out["busy_retries"] = sum(t.busy_retries for t in timings)
    errors = [t.error for t in timings if t.error is not None]
    if errors:
        out["errors"] = errors[:5]
    return out


# ------------------------------------------------------------------ running
