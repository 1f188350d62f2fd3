"""``sluice bench host``: the host's share of a decode step, the forward stubbed."""

from __future__ import annotations

import argparse
import json

from services.bench import host


def test_the_host_share_is_measured_per_batch() -> None:
    p = argparse.ArgumentParser()
    host.add_arguments(p)
    out = json.loads(
        json.dumps(host.run(p.parse_args(["--batches", "1,8", "--steps", "5", "--warmup", "1"])).to_json())
    )
    res = out["results"]
    assert set(res) == {"1", "8"}
    assert all(r["ms_per_step"] > 0 and r["us_per_sequence"] > 0 for r in res.values())
    assert res["8"]["us_per_sequence"] == res["8"]["ms_per_step"] * 1e3 / 8
