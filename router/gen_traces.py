"""Generated Mooncake-format traces: "long documents" and "agents" (deterministic per seed).

Both return a ``router.trace.Trace`` (what the simulator replays) and write the Mooncake
JSONL rows (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids`` of 512-token
chained prefix blocks) with ``write_jsonl``, so ``load_trace`` reads them back unchanged.

* **Long documents** (``LongDocsParams``): Poisson arrivals; exactly
  ``round(long_fraction * requests)`` requests, at seeded random positions, have a
  log-uniform input length in ``[long_min, long_max]``; the rest are ordinary (log-normal
  input around ``short_median``, clipped below ``long_min``). No prefix is shared.
* **Agents** (``AgentParams``): ``sessions`` conversations of ``turns`` turns, started as a
  Poisson process (first input log-normal, at least one block); turns of one session follow each other after an exponential think/tool
  time. Turn t's input is the whole previous turn (its input and output) followed by new
  tokens, sized so that the previous turn is ``reuse`` of the new input:
  ``input_t = ceil((input_{t-1} + output_{t-1}) / reuse)``. In blocks, turn t repeats the
  full blocks of turn t-1's input (the partial last block and the output get new ids, as
  a chained hash would), so the block-level reuse is slightly below ``reuse``;
  ``prefix_reuse`` measures it.

Run ``python -m router.gen_traces --out DIR`` to write both files.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from router.trace import Trace

BLOCK = 512


@dataclass(frozen=True)
class LongDocsParams:
    requests: int = 4000
    long_fraction: float = 0.10
    long_min: int = 65_536  # 64K tokens
    long_max: int = 262_144  # 256K tokens
    short_median: int = 4096  # ordinary requests: log-normal input
    short_sigma: float = 1.0
    output_median: int = 256  # every request: log-normal output
    output_sigma: float = 0.8
    output_max: int = 4096
    rate_per_s: float = 10.0  # Poisson arrivals (the benches rescale time anyway)

    def __post_init__(self) -> None:
        if self.requests < 1 or not 0 <= self.long_fraction <= 1 or not 0 < self.long_min <= self.long_max:
            raise ValueError(f"bad LongDocsParams {self}")


@dataclass(frozen=True)
class AgentParams:
    sessions: int = 400
    turns: int = 20
    reuse: float = 0.95  # previous turn's tokens / this turn's input tokens
    first_median: int = 4096  # first turn's input: log-normal
    first_sigma: float = 0.5
    output_median: int = 256  # tool calls and answers: log-normal output
    output_sigma: float = 0.8
    output_max: int = 4096
    session_rate_per_s: float = 0.5  # Poisson session starts: ~50 sessions live at once
    think_mean_s: float = 5.0  # exponential gap between a session's turns

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.turns < 1 or not 0 < self.reuse < 1:
            raise ValueError(f"bad AgentParams {self}")


def _lognormal(rng: np.random.Generator, median: int, sigma: float, n: int, lo: int, hi: int) -> np.ndarray:
    x = np.exp(rng.normal(math.log(median), sigma, n))
    return np.clip(np.round(x), lo, hi).astype(np.int64)


def _trace(name: str, rows: list[tuple[float, int, int, tuple[int, ...]]]) -> Trace:
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return Trace(
        name,
        np.array([r[0] - t0 for r in rows]),
        np.array([r[1] for r in rows], dtype=np.int64),
        np.array([r[2] for r in rows], dtype=np.int64),
        tuple(r[3] for r in rows),
        BLOCK,
    )


def long_documents(seed: int = 0, p: LongDocsParams = LongDocsParams()) -> Trace:
    rng = np.random.default_rng(seed)
    n = p.requests
    arrival = np.cumsum(rng.exponential(1.0 / p.rate_per_s, n))
    n_long = round(p.long_fraction * n)
    is_long = np.zeros(n, dtype=bool)
    is_long[rng.permutation(n)[:n_long]] = True
    lengths = _lognormal(rng, p.short_median, p.short_sigma, n, 1, p.long_min - 1)
    long_len = np.exp(rng.uniform(math.log(p.long_min), math.log(p.long_max), n))
    lengths = np.where(is_long, np.clip(np.round(long_len), p.long_min, p.long_max), lengths).astype(np.int64)
    outputs = _lognormal(rng, p.output_median, p.output_sigma, n, 2, p.output_max)
    rows, next_id = [], 0
    for i in range(n):
        nb = -(-int(lengths[i]) // BLOCK)
        rows.append(
            (float(arrival[i]), int(lengths[i]), int(outputs[i]), tuple(range(next_id, next_id + nb)))
        )
        next_id += nb
    return _trace("long_documents", rows)


def agents(seed: int = 0, p: AgentParams = AgentParams()) -> Trace:
    rng = np.random.default_rng(seed)
    starts = np.cumsum(rng.exponential(1.0 / p.session_rate_per_s, p.sessions))
    rows: list[tuple[float, int, int, tuple[int, ...]]] = []
    next_id = 0
    for s in range(p.sessions):
        t = float(starts[s])
        n_in = int(_lognormal(rng, p.first_median, p.first_sigma, 1, BLOCK, 10**9)[0])
        blocks: tuple[int, ...] = ()
        for turn in range(p.turns):
            n_out = int(_lognormal(rng, p.output_median, p.output_sigma, 1, 2, p.output_max)[0])
            if turn:
                prev_in, prev_out = rows[-1][1], rows[-1][2]
                n_in = math.ceil((prev_in + prev_out) / p.reuse)
                blocks = blocks[: prev_in // BLOCK]  # the previous input's full blocks
            fresh = -(-n_in // BLOCK) - len(blocks)
            blocks = blocks + tuple(range(next_id, next_id + fresh))
            next_id += fresh
            rows.append((t, n_in, n_out, blocks))
            t += float(rng.exponential(p.think_mean_s))
    return _trace("agents", rows)


def prefix_reuse(trace: Trace) -> float:
    """Block-level reuse: input tokens covered by a prefix of blocks some earlier request
    had, over the input tokens of the requests that reuse anything (later turns)."""
    seen: set[int] = set()
    hit = total = 0
    for n_in, blocks in zip(trace.input_len.tolist(), trace.blocks):
        m = 0
        for b in blocks:
            if b not in seen:
                break
            m += 1
        if m:
            hit += min(m * trace.block_size, n_in)
            total += n_in
        seen.update(blocks)
    return hit / total if total else 0.0


def describe(trace: Trace, params: Any) -> dict[str, Any]:
    """What the bench prints about a generated trace: its parameters and measured shape."""
    lens = trace.input_len
    out: dict[str, Any] = {"params": asdict(params), "rows": len(trace)}
    out["input_tokens_p50_p99_max"] = [
        int(np.percentile(lens, 50)),
        int(np.percentile(lens, 99)),
        int(lens.max()),
    ]
    out["output_tokens_mean"] = float(trace.output_len.mean())
    if isinstance(params, LongDocsParams):
        out["long_fraction_measured"] = float(np.mean(lens >= params.long_min))
    if isinstance(params, AgentParams):
        out["prefix_reuse_measured"] = prefix_reuse(trace)
    return out


def write_jsonl(trace: Trace, path: str | Path) -> None:
    with Path(path).open("w") as f:
        for i in range(len(trace)):
            row = {
                "timestamp": int(round(float(trace.arrival_s[i]) * 1000)),
                "input_length": int(trace.input_len[i]),
                "output_length": int(trace.output_len[i]),
                "hash_ids": list(trace.blocks[i]),
            }
            f.write(json.dumps(row) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--out", type=Path, required=True, help="directory for long_documents.jsonl and agents.jsonl"
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for trace, params in ((long_documents(args.seed), LongDocsParams()), (agents(args.seed), AgentParams())):
        write_jsonl(trace, args.out / f"{trace.name}.jsonl")
        print(trace.name, json.dumps(describe(trace, params)))


if __name__ == "__main__":
    main()
