"""examples/offline_inference.py runs end to end on its default, the shipped trained preset
(the model `make run` serves), and on a random preset given with --model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location(
        "offline_inference", ROOT / "examples" / "offline_inference.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_default_model_is_the_trained_preset(example, tmp_path, monkeypatch):
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path))
    monkeypatch.delenv("SLUICE_MODEL_DIR", raising=False)
    assert example.model_dir(None) == ROOT / "models" / "trained"
    assert example.model_dir(None, "trained") == ROOT / "models" / "trained"
    assert example.model_dir("some/dir") == Path("some/dir")
    monkeypatch.setenv("SLUICE_MODEL_DIR", str(tmp_path / "weights"))
    assert example.model_dir(None) == tmp_path / "weights"
    assert example.model_dir(None, "trained") == ROOT / "models" / "trained"  # --preset beats the env
    assert not (tmp_path / "checkpoints").exists()  # nothing generated


def _check(out: str) -> None:
    assert "valid JSON: True" in out
    assert "follow-up turn: 0 of" not in out and "follow-up turn:" in out  # the follow-up hit the cache


def test_offline_example_runs_on_its_default_the_trained_preset(example, monkeypatch, capsys):
    monkeypatch.delenv("SLUICE_MODEL_DIR", raising=False)
    assert example.main(["--max-tokens", "8"]) == 0
    _check(capsys.readouterr().out)


def test_offline_example_runs_on_a_random_preset(example, checkpoint_factory, capsys):
    assert example.main(["--model", str(checkpoint_factory("tiny")), "--max-tokens", "8"]) == 0
    _check(capsys.readouterr().out)
