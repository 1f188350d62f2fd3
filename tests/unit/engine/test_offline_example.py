"""examples/offline_inference.py runs end to end on the generated tiny preset (what `make run` does)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_offline_example_runs_on_tiny_preset(checkpoint_factory, capsys):
    spec = importlib.util.spec_from_file_location(
        "offline_inference", ROOT / "examples" / "offline_inference.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--model", str(checkpoint_factory("tiny")), "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "valid JSON: True" in out
    assert "follow-up turn: 0 of" not in out and "follow-up turn:" in out  # the follow-up hit the cache
