"""``sluice bench engine --mixed``: steps of decode rows beside a prompt, one pass against two."""

from __future__ import annotations

import argparse
import json

from services.bench import engine


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    engine.add_arguments(p)
    return p.parse_args(list(argv))


def test_the_mixed_report_times_one_pass_against_two_on_the_same_steps() -> None:
    report = engine.run(_args("--mixed", "1,3", "--prompt-tokens", "40", "--context", "30", "--repeats", "2"))
    out = json.loads(json.dumps(report.to_json()))
    assert [r["decodes"] for r in out["rows"]] == [1, 3]
    for n in (1, 3):
        cell = out["results"][f"decodes_{n}"]
        # every round's mixed step ran in two passes on the splitting runner (the untimed one too)
        assert cell["split_steps"] == 3
        for mode in ("one pass", "two passes"):
            assert len(cell["rounds"][mode]) == 2
            assert all(v > 0 for r in cell["rounds"][mode] for v in r.values())
        ms = cell["ms_median"]
        assert cell["two_passes_over_one"] == ms["two passes"]["mixed"] / ms["one pass"]["mixed"]
    assert out["config"]["mixed_decodes"] == [1, 3] and out["targets"] == []
