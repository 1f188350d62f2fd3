"""``sluice bench vision`` end to end with tiny settings: the JSON's shape and sane values
(not the target verdicts, which depend on the machine)."""

from __future__ import annotations

import argparse
import json
import math
import statistics

import pytest

from services.bench import render_table, vision


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    vision.add_arguments(p)
    return p.parse_args(list(argv))


def test_defaults_are_the_small_preset() -> None:
    args = _args()
    assert args.model is None and args.preset == "small"
    with pytest.raises(ValueError):
        vision.run(_args("--repeats", "0"))


@pytest.mark.timeout(120)
@pytest.mark.slow  # a bench smoke run (~7 s): `make test-slow`
def test_tiny_run_reports_the_declared_targets_and_sane_values(checkpoint_factory) -> None:
    model = checkpoint_factory("tiny")
    report = vision.run(_args("--model", str(model), "--images", "2", "--rounds", "1", "--repeats", "1"))
    out = json.loads(json.dumps(report.to_json()))  # what --json prints
    assert out["bench"] == "vision"
    assert {"machine", "config", "results", "targets"} <= out.keys()
    targets = {t["name"]: t for t in out["targets"]}
    assert set(targets) == {
        "images/s: 2 pinned encoder instances / 1",
        "image TTFT / (preprocess + encode + same-length text TTFT), median of per-repeat ratios",
        "encoder-cache hit TTFT / same-length text TTFT, median of per-repeat ratios",
    }
    assert [(t["op"], t["target"]) for t in out["targets"]] == [(">=", 1.6), ("<=", 1.1), ("<=", 1.05)]
    for t in out["targets"]:
        assert math.isfinite(t["value"]) and t["value"] > 0 and isinstance(t["met"], bool)

    enc = out["results"]["encoder"]
    assert [r["instances"] for r in enc["rounds"]] == [1, 2]
    assert enc["rounds"][0]["images"] == 2 and enc["rounds"][1]["images"] == 4
    for r in enc["rounds"]:
        assert r["images_per_s"] > 0
        for inst in r["per_instance"]:
            assert inst["affinity"] == [inst["core"]]  # pinned to its one core
            assert inst["cpu_s"] > 0 and inst["cpu_over_wall"] < 1.5  # one thread
    assert enc["scaling"] == pytest.approx(
        enc["two_instances_images_per_s"] / enc["one_instance_images_per_s"]
    )

    tt = out["results"]["ttft"]
    tokens = tt["prompt_tokens"]
    assert tokens["image"] > tokens["text"] > 0 and tokens["hit"] == tokens["image"]
    assert abs(tokens["same_len"] - tokens["image"]) <= 2
    med = tt["median_s"]
    assert set(med) == {"text", "image", "hit", "same_len", "encode", "preprocess"}
    assert all(0 < v < 30 for v in med.values())
    hit = targets["encoder-cache hit TTFT / same-length text TTFT, median of per-repeat ratios"]["value"]
    times = tt["all_s"]
    assert hit == pytest.approx(statistics.median(h / s for h, s in zip(times["hit"], times["same_len"])))
    assert tt["hit_over_same_len"] == pytest.approx(med["hit"] / med["same_len"])
    assert tt["hit_over_text"] == pytest.approx(med["hit"] / med["text"])
    vs = tt["server_vision_stats"]
    assert vs["vision_images_encoded"] >= 2 and vs["vision_cache_hits"] >= 2  # warm-up + 1 repeat
    table = render_table(report)
    assert "encoder x2 (pinned)" in table and "ttft hit" in table and "targets:" in table
