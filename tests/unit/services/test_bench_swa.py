"""`sluice bench swa`: trace accounting, slot bytes, and the replay timing on a tiny model."""

from __future__ import annotations

import argparse

import pytest

from engine.cache.spec import CacheSpec
from engine.config import CSA, HCA, SLIDING
from services.bench import swa

# 2 layers, window 4: exact replay caps at 2 * 3 = 6 tokens, bounded at 3.
TRACE = [
    ((1, 2), 1000),  # miss; saves (1,) (one full block)
    ((1, 3), 1024),  # hit 512 (block 1); host slot (1,) hit; saves (1, 3)
    ((1, 3, 4), 1100),  # hit 1024; host slot (1, 3) hit
    ((5,), 100),  # miss; no full block: nothing saved under full_blocks
    ((5,), 100),  # hit capped at 99; host misses under full_blocks, hits under full_chain
    ((1, 9), 600),  # hit 512; slot (1,) only if the pool kept it
]


def _account(slots, rule="full_blocks"):
    blocks, lengths = zip(*TRACE)
    return swa.trace_accounting(blocks, lengths, 512, 2, 4, slots, rule)


def test_trace_accounting_known_answers() -> None:
    acc = _account([1000, 1, 0])
    assert acc["input_tokens"] == 3924
    assert acc["hits"] == 4 and acc["hit_tokens"] == 512 + 1024 + 99 + 512
    assert acc["computed_without_replay"] == 1000 + 512 + 76 + 100 + 1 + 88
    assert acc["replay_tokens"] == {"exact": 4 * 6, "bounded": 4 * 3}
    assert acc["prefill_tokens"]["exact"] == 1777 + 24
    assert acc["prefill_tokens"]["bounded"] == 1777 + 12
    big, one, none = acc["host"]
    assert (big["slot_hits"], big["replay_tokens"]) == (3, 3)  # only the capped 99-token hit misses
    assert (one["slot_hits"], one["replay_tokens"]) == (2, 6)  # (1,) was evicted by (1, 3)
    assert (none["slot_hits"], none["replay_tokens"]) == (0, 12)  # no pool: bounded
    assert acc["prefill_tokens"]["exact"] >= acc["prefill_tokens"]["bounded"] >= big["prefill_tokens"]


def test_trace_accounting_full_chain_key() -> None:
    (host,) = _account([1000], "full_chain")["host"]
    # (1,) is never a full chain; (1, 3) and (5,) are: requests 3 and 5 hit, 2 and 6 replay 3
    assert (host["slot_hits"], host["replay_tokens"]) == (2, 6)
    with pytest.raises(ValueError):
        _account([1], "nope")


def test_replay_caps() -> None:
    assert swa.exact_replay(16384, 43, 128) == 5461 and swa.exact_replay(4096, 43, 128) == 4096
    assert swa.bounded_replay(16384, 128) == 127 and swa.bounded_replay(100, 128) == 100


def test_slot_bytes_arithmetic() -> None:
    assert swa.mxfp8_bytes(512) == 528 and swa.mxfp8_bytes(256) == 264
    cfg = {"head_dim": 512, "index_head_dim": 128, "sliding_window": 134}
    # DeepSeek's figure: 20 layers x 134 tokens x 528 bytes, a window-only slot
    assert swa.slot_bytes([SLIDING] * 20, cfg, "mxfp8")["total"] == swa.DEEPSEEK_SLOT_BYTES
    cfg["sliding_window"] = 128
    types = [SLIDING, CSA, HCA, CSA]
    bf16 = swa.slot_bytes(types, cfg, "bf16")
    assert bf16["total"] == CacheSpec(tuple(types), 512, 128, 128, 4, 128, 2, 2).slot_bytes()
    mx = swa.slot_bytes(types, cfg, "mxfp8")
    assert mx["window"] == 4 * 128 * 528
    assert mx["compressor"] == 2 * (2 * 8 * 2 * 528) + 2 * 128 * 528
    assert mx["indexer"] == 2 * (2 * 8 * 264)
    rep = swa.slot_bytes_report()
    assert rep["bf16"]["total"] == rep["bf16"]["cache_spec_slot_bytes"]
    assert rep["kept_layers"]["count"] == 20 and rep["mxfp8"]["window"] == 20 * 128 * 528


def test_replay_timing_on_a_tiny_checkpoint(checkpoint_factory) -> None:
    path = checkpoint_factory("tiny")
    (row,) = swa.time_replay(path, [320], repeats=1, chunk=256, device="cpu", dtype="float32", seed=0)
    assert (row["layers"], row["window"], row["context"]) == (4, 32, 320)
    assert row["exact_tokens"] == 4 * 31 and row["bounded_tokens"] == 31
    assert row["bounded_tokens"] < row["exact_tokens"]
    for key in ("prefill_s", "exact_s", "bounded_s", "exact_replay_s", "bounded_decode_s"):
        assert row[key] > 0
    assert row["bounded_over_exact"] == row["bounded_s"] / row["exact_s"]
    assert row["bounded_over_exact_min"] == row["bounded_min_s"] / row["exact_min_s"]
    assert len(row["exact_all_s"]) == len(row["bounded_all_s"]) == 1
    assert swa.target_cell([row]) is row
    # the fetch of the slot (with its 64-token partial block) from a loopback slot server
    assert row["fetch_s"] > 0 and row["fetch_over_bounded"] == row["fetch_s"] / row["bounded_s"]
    assert row["fetch_bytes"] > 0


def test_run_without_timing_reports_trace_and_bytes(tmp_path) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [(0, n, list(b)) for b, n in TRACE]
    trace.write_text(
        "".join(
            f'{{"timestamp": {t}, "input_length": {n}, "output_length": 1, "hash_ids": {b}}}\n'
            for t, n, b in rows
        )
    )
    parser = argparse.ArgumentParser()
    swa.add_arguments(parser)
    report = swa.run(parser.parse_args(["--no-timing", "--trace", str(trace), "--host-gib", "1"]))
    out = report.to_json()
    assert out["bench"] == "swa" and out["targets"] == []
    res = out["results"]
    assert set(res) >= {"slot_bytes", "trace"} and "timing" not in res
    fb = res["trace"]["full_blocks"]
    # 43 layers x 127 exceeds every hit here: exact replay recomputes the whole prompt
    assert fb["prefill_tokens"]["exact"] == 3924 and fb["host"][0]["gib"] == 1
    assert res["trace"]["host_budgets"][0]["slots"] == 2**30 // res["slot_bytes"]["mxfp8"]["total"]
