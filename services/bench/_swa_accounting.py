"""`sluice bench swa`'s pure accounting (no torch, no model): the replay lengths
(`exact_replay`, `bounded_replay`), part 2's prefill tokens on a trace (`trace_accounting`,
`trace_report`) and part 3's slot bytes (`mxfp8_bytes`, `slot_bytes`, `slot_bytes_report`).
`services.bench.swa`'s module doc says what each part measures.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

REPO = Path(__file__).resolve().parents[2]

# V4-Flash shape for the trace accounting and the slot bytes.
FLASH_LAYERS, FLASH_WINDOW = 43, 128
KEPT_LAYERS = 20  # V4.1-Flash layers whose SWA state DeepSeek keeps in host memory
DEEPSEEK_TOKENS_PER_LAYER = 134
DEEPSEEK_SLOT_BYTES = 1_415_040  # 20 layers x 134 tokens x 528 bytes
MX_BLOCK = 32  # MXFP8: one power-of-two scale byte per 32 e4m3 values
GIB = 1024**3


# ------------------------------------------------------------------ replay lengths
def exact_replay(hit: int, layers: int, window: int) -> int:
    return min(hit, layers * (window - 1))


def bounded_replay(hit: int, window: int) -> int:
    return min(hit, window - 1)


# ------------------------------------------------------------------ 3. slot bytes
def mxfp8_bytes(values: int) -> int:
    """e4m3 bytes plus one scale byte per 32 values (rows padded to a whole block)."""
    return values + -(-values // MX_BLOCK)


def slot_bytes(layer_types: Sequence[str], cfg: dict[str, Any], fmt: str) -> dict[str, int]:
    """One sequence's SWA slot in our layout (``SWASlots``): per layer the raw window
    ``W x head_dim``; CSA layers add the compressor rings kv and gate ``2m x 2 head_dim`` and
    the indexer rings ``2m x 2 index_head_dim``; HCA layers add kv and gate ``m' x head_dim``.
    ``fmt``: ``bf16`` (2 bytes a value) or ``mxfp8`` (every row quantised on its own)."""
    from engine.config import CSA, HCA

    def rows(n: int, width: int) -> int:
        return n * (2 * width if fmt == "bf16" else mxfp8_bytes(width))

    if fmt not in ("bf16", "mxfp8"):
        raise ValueError(f"unknown format {fmt!r}")
    d, di, w = int(cfg["head_dim"]), int(cfg["index_head_dim"]), int(cfg["sliding_window"])
    m, mh = int(cfg.get("compress_rate_csa", 4)), int(cfg.get("compress_rate_hca", 128))
    window = compressor = indexer = 0
    for t in layer_types:
        window += rows(w, d)
        if t == CSA:
            compressor += 2 * rows(2 * m, 2 * d)
            indexer += 2 * rows(2 * m, 2 * di)
        elif t == HCA:
            compressor += 2 * rows(mh, d)
    return {
        "window": window,
        "compressor": compressor,
        "indexer": indexer,
        "total": window + compressor + indexer,
    }


def slot_bytes_report(kept: int = KEPT_LAYERS) -> dict[str, Any]:
    from engine.cache.spec import CacheSpec
    from engine.checkpoint.presets import preset_config
    from engine.config import CSA, HCA, SLIDING

    cfg = preset_config("flash-shape", num_hidden_layers=FLASH_LAYERS)
    types = list(cfg["layer_types"])[:kept]
    out: dict[str, Any] = {
        "shape": f"flash-shape preset resized to {FLASH_LAYERS} layers; the first {kept} kept",
        "head_dim": cfg["head_dim"],
        "index_head_dim": cfg["index_head_dim"],
        "window": cfg["sliding_window"],
        "kept_layers": {
            "count": kept,
            "sliding": types.count(SLIDING),
            "csa": types.count(CSA),
            "hca": types.count(HCA),
        },
    }
    for fmt in ("bf16", "mxfp8"):
        b = slot_bytes(types, cfg, fmt)
        out[fmt] = {**b, "window_only": b["window"]}
    # Cross-check the bf16 figure against the engine's own formula (CacheSpec at 2-byte elements).
    spec = CacheSpec(
        tuple(types), cfg["head_dim"], cfg["index_head_dim"], cfg["sliding_window"], 4, 128, 2, 2
    )
    out["bf16"]["cache_spec_slot_bytes"] = spec.slot_bytes()
    out["deepseek"] = {
        "bytes": DEEPSEEK_SLOT_BYTES,
        "formula": f"{kept} layers x {DEEPSEEK_TOKENS_PER_LAYER} tokens x {mxfp8_bytes(512)} bytes",
    }
    out["mxfp8_window_only_vs_deepseek"] = out["mxfp8"]["window"] / DEEPSEEK_SLOT_BYTES
    out["mxfp8_total_vs_deepseek"] = out["mxfp8"]["total"] / DEEPSEEK_SLOT_BYTES
    return out


# ------------------------------------------------------------------ 2. trace accounting
def trace_accounting(
    blocks: Sequence[Sequence[int]],
    input_len: Sequence[int] | npt.NDArray[np.integer],
    block_size: int,
    layers: int,
    window: int,
    host_slots: Sequence[int] = (),
    key_rule: str = "full_blocks",
) -> dict[str, Any]:
    """Prefill tokens of requests replayed in order against an unbounded prefix cache.

    A block is cached once any earlier request had it. A request's hit is the tokens of its
    leading cached blocks, capped at ``input_len - 1`` (one token is always computed). A
    request computes ``input_len - hit`` tokens plus the replay of its policy:

    - ``exact``: ``min(hit, layers * (window - 1))``;
    - ``bounded``: ``min(hit, window - 1)``;
    - ``host[N]``: an LRU pool of N host slots; 0 when the pool holds a slot whose key is the
      request's leading cached block chain (``blocks[:k]`` for a hit of k blocks), else
      ``bounded``. After each request its slot is saved (most recently used), keyed by
      ``key_rule``: ``full_blocks`` = the chain of the request's full blocks
      (``blocks[:input_len // block_size]``: the state at the last block boundary of its
      prompt, which a later turn extending the prompt can use); ``full_chain`` = every
      hash id, the partial last block included (the state at the prompt's end). A slot used
      by a hit is refreshed too. Policies with N = 0 slots are bounded.
    """
    if key_rule not in ("full_blocks", "full_chain"):
        raise ValueError(f"unknown key rule {key_rule!r}")
    seen: set[int] = set()
    pools: list[OrderedDict[tuple[int, ...], None]] = [OrderedDict() for _ in host_slots]
    host_hits = [0] * len(host_slots)
    host_replay = [0] * len(host_slots)
    new = exact = bounded = 0
    hits = 0
    hit_tokens = 0
    total_input = 0
    for chain, n in zip(blocks, input_len):
        chain = tuple(int(b) for b in chain)
        n = int(n)
        k = 0
        for b in chain:
            if b not in seen:
                break
            k += 1
        hit = min(k * block_size, n - 1)
        total_input += n
        new += n - hit
        if hit > 0:
            hits += 1
            hit_tokens += hit
        exact += exact_replay(hit, layers, window)
        b_r = bounded_replay(hit, window)
        bounded += b_r
        key_hit = chain[:k]
        saved = chain[: n // block_size] if key_rule == "full_blocks" else chain
        for i, (pool, cap) in enumerate(zip(pools, host_slots)):
            if hit > 0 and key_hit in pool:
                host_hits[i] += 1
                pool.move_to_end(key_hit)
            else:
                host_replay[i] += b_r
            if cap > 0 and saved:
                pool[saved] = None
                pool.move_to_end(saved)
                while len(pool) > cap:
                    pool.popitem(last=False)
        seen.update(chain)
    out: dict[str, Any] = {
        "requests": len(input_len),
        "input_tokens": total_input,
        "hits": hits,
        "hit_tokens": hit_tokens,
        "computed_without_replay": new,
        "replay_tokens": {"exact": exact, "bounded": bounded},
        "prefill_tokens": {"exact": new + exact, "bounded": new + bounded},
        "host": [],
    }
    for cap, h, r in zip(host_slots, host_hits, host_replay):
        out["host"].append({"slots": cap, "slot_hits": h, "replay_tokens": r, "prefill_tokens": new + r})
    return out


def trace_report(path: Path, host_gib: Sequence[int], slot_size: int) -> dict[str, Any]:
    from router.trace import load_trace

    trace = load_trace(path)
    slots = [int(g * GIB // slot_size) for g in host_gib]
    res: dict[str, Any] = {"trace": str(path.relative_to(REPO) if path.is_relative_to(REPO) else path)}
    res["shape"] = {"layers": FLASH_LAYERS, "window": FLASH_WINDOW, "block_tokens": trace.block_size}
    res["exact_replay_cap"] = FLASH_LAYERS * (FLASH_WINDOW - 1)
    res["bounded_replay_cap"] = FLASH_WINDOW - 1
    res["host_slot_bytes"] = slot_size
    res["host_budgets"] = [{"gib": g, "bytes": g * GIB, "slots": s} for g, s in zip(host_gib, slots)]
    for rule in ("full_blocks", "full_chain"):
        acc = trace_accounting(
            trace.blocks, trace.input_len, trace.block_size, FLASH_LAYERS, FLASH_WINDOW, slots, rule
        )
        ex, bo = acc["prefill_tokens"]["exact"], acc["prefill_tokens"]["bounded"]
        acc["bounded_over_exact"] = bo / ex
        for h, g in zip(acc["host"], host_gib):
            h["gib"] = g
            h["host_over_exact"] = h["prefill_tokens"] / ex
        res[rule] = acc
    return res
