"""Mooncake trace loading (FAST'25 format) and infinite-cache reference hits.

One JSON object per line: ``timestamp`` (ms since trace start), ``input_length``,
``output_length`` and ``hash_ids`` (chained 512-token prefix block ids, one per started
block). Rows are kept in file order, which is non-decreasing in timestamp.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from costmodel import CostModel


@dataclass(frozen=True)
class Trace:
    name: str
    arrival_s: np.ndarray  # [R] float64 seconds since the first row
    input_len: np.ndarray  # [R] int64
    output_len: np.ndarray  # [R] int64
    blocks: tuple[tuple[int, ...], ...]  # [R][n_blocks]
    block_size: int = 512

    def __len__(self) -> int:
        return len(self.input_len)

    def head(self, n: int) -> Trace:
        """The first ``n`` rows (a prefix keeps every earlier turn a later one may reuse)."""
        return Trace(
            self.name,
            self.arrival_s[:n],
            self.input_len[:n],
            self.output_len[:n],
            self.blocks[:n],
            self.block_size,
        )


def load_trace(path: str | Path, block_size: int = 512, limit: int | None = None) -> Trace:
    """Read a Mooncake JSONL trace; raises ValueError naming the file and line on bad rows."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(
            f"trace file {p} not found; pass --trace PATH (Mooncake JSONL, see data/traces/SOURCE.md)"
        )
    ts: list[float] = []
    lin: list[int] = []
    lout: list[int] = []
    blocks: list[tuple[int, ...]] = []
    with p.open() as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(ts) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                t, n_in, n_out = float(row["timestamp"]), int(row["input_length"]), int(row["output_length"])
                h = tuple(int(x) for x in row["hash_ids"])
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{p}:{lineno}: not a Mooncake trace row ({exc})") from exc
            if n_in < 1 or n_out < 0 or len(h) != -(-n_in // block_size):
                raise ValueError(
                    f"{p}:{lineno}: input_length {n_in} needs {-(-n_in // block_size)} hash_ids "
                    f"of {block_size} tokens, row has {len(h)}"
                )
            ts.append(t / 1000.0)
            lin.append(n_in)
            lout.append(n_out)
            blocks.append(h)
    if not ts:
        raise ValueError(f"trace file {p} has no rows")
    arr = np.asarray(ts)
    order = np.argsort(arr, kind="stable")
    return Trace(
        p.stem,
        arr[order] - arr[order][0],
        np.asarray(lin, dtype=np.int64)[order],
        np.asarray(lout, dtype=np.int64)[order],
        tuple(blocks[i] for i in order),
        block_size,
    )


def infinite_cache_blocks(trace: Trace) -> np.ndarray:
    """Per request, the prefix blocks an infinite cache shared by all engines would hit."""
    seen: set[int] = set()
    out = np.zeros(len(trace), dtype=np.int64)
    for i, blocks in enumerate(trace.blocks):
        n = 0
        for b in blocks:
            if b not in seen:
                break
            n += 1
        out[i] = n
        seen.update(blocks)
    return out


def cached_tokens(trace: Trace, matched_blocks: np.ndarray) -> np.ndarray:
    return np.minimum(matched_blocks * trace.block_size, trace.input_len)


def reference_work(trace: Trace, cost: CostModel) -> np.ndarray:
    """Per request, prefill seconds with every infinite-cache hit taken (the least work)."""
    hits = cached_tokens(trace, infinite_cache_blocks(trace))
    return np.array([cost.prefill_time(int(n), int(h)) for n, h in zip(trace.input_len, hits)])
