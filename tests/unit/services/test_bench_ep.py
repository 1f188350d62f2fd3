"""`sluice bench ep` on CPU (gloo, tiny preset): the JSON contract, EP1 vs EP2 figures, and an
EPLB remap done while serving that lowers the measured imbalance."""

from __future__ import annotations

import argparse
import json

import pytest

from services.bench import ep


def _args(**over: object) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    ep.add_arguments(p)
    argv = ["--device", "cpu", "--preset", "tiny", "--prefill-tokens", "128", "--decode-batches", "2,4",
            "--decode-context", "16", "--decode-steps", "2", "--repeats", "1", "--warmup", "1",
            "--eplb-steps", "6", "--eplb-window", "2", "--eplb-period", "4", "--eplb-redundant", "2"]  # fmt: skip
    args = p.parse_args(argv)
    for k, v in over.items():
        setattr(args, k, v)
    return args


@pytest.mark.slow  # make test-slow: keeps make test under 15 minutes on 2 cores
def test_bench_ep_cpu_reports_scaling_and_eplb() -> None:
    report = ep.run(_args())
    doc = json.loads(json.dumps(report.to_json()))
    assert doc["bench"] == "ep" and set(doc) == {"bench", "machine", "config", "results", "targets", "rows"}
    res = doc["results"]
    for world in (1, 2):
        tp = res[f"ep{world}"]["throughput"]
        assert tp["prefill"]["tok_per_s_per_gpu"] > 0
        assert [d["requests_per_rank"] for d in tp["decode"]] == [2, 4]
    names = [t["name"] for t in doc["targets"]]
    assert any("prefill scaling" in n for n in names) and sum("decode" in n for n in names) == 2
    eplb = res["ep2"]["eplb"]
    assert eplb["remap_steps"] == [3]  # decided after step 2 (window 2), moved after step 3
    assert eplb["remap_layers"] == 2 and eplb["remap_bytes_sent_all_ranks"] > 0
    assert eplb["remap_bytes_sent_all_ranks"] == eplb["remap_bytes_received_all_ranks"]
    assert eplb["imbalance_after"] < eplb["imbalance_before"]
    assert any("EPLB imbalance" in n for n in names)


def test_bench_ep_rejects_uneven_prefill_split() -> None:
    with pytest.raises(ValueError, match="multiple of --prefill-seqs"):
        ep.run(_args(prefill_tokens=127))
