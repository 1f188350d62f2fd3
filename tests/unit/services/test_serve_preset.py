"""``sluice serve --preset`` and the default model; ``sluice gen-checkpoint`` refuses a shipped
preset. No model is loaded here."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cli import build_parser, main
from services.commands.serve import api_config_from

TRAINED = Path(__file__).resolve().parents[3] / "models" / "trained"


def _model(argv: list[str]) -> Path:
    return api_config_from(build_parser().parse_args(["serve", *argv]))[3]


@pytest.fixture(autouse=True)
def _home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path))
    monkeypatch.delenv("SLUICE_MODEL_DIR", raising=False)
    return tmp_path


def test_the_default_is_the_shipped_trained_preset(tmp_path: Path) -> None:
    assert _model([]) == TRAINED
    assert _model(["--preset", "trained"]) == TRAINED
    assert not (tmp_path / "checkpoints").exists()  # nothing generated


def test_precedence_model_preset_file_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_MODEL_DIR", str(tmp_path / "env"))
    assert _model([]) == tmp_path / "env"
    assert _model(["--preset", "trained"]) == TRAINED
    assert _model(["--model", str(tmp_path / "flag")]) == tmp_path / "flag"
    spec = tmp_path / "cluster.yaml"
    spec.write_text(f"mode: embedded\nmodel: {tmp_path / 'file'}\n")
    assert _model(["--config", str(spec)]) == tmp_path / "file"
    assert _model(["--config", str(spec), "--preset", "trained"]) == TRAINED


@pytest.mark.parametrize(
    "argv", [["--model", "x", "--preset", "tiny"], ["--preset", "nope"]], ids=["both", "unknown"]
)
def test_bad_preset_flags_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "not allowed with" in err or "invalid choice" in err


def test_a_missing_shipped_preset_exits_2_with_its_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from engine.checkpoint import presets

    monkeypatch.setitem(presets.SHIPPED, "trained", tmp_path / "gone")
    assert main(["serve", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "shipped preset 'trained' is missing" in err and str(tmp_path / "gone") in err


def test_gen_checkpoint_refuses_the_shipped_preset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["gen-checkpoint", "--preset", "trained", "--out", str(tmp_path / "out")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "'trained' is a shipped preset" in err and "not generated" in err
    assert not (tmp_path / "out").exists()
    args = build_parser().parse_args(["gen-checkpoint", "--out", "x"])
    assert args.preset == "tiny"  # gen-checkpoint's default stays the random tiny preset
