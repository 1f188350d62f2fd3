"""scripts/mtp_into_checkpoint.py: a device run's MTP tensors put back into the checkpoint it
started from, every other tensor, the metadata and the other files the base's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "mtp_into_checkpoint.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_the_mtp_tensors_replace_the_bases_and_nothing_else(tmp_path: Path) -> None:
    base = tmp_path / "base"
    (base / "confidence").mkdir(parents=True)
    state = {"lm.w": torch.randn(3, 4), "mtp.0.w": torch.randn(2, 2), "mtp.0.b": torch.randn(2)}
    save_file(state, str(base / "model.safetensors"), metadata={"format": "pt", "note": "kept"})
    (base / "config.json").write_text("{}")
    (base / "confidence" / "model.safetensors").write_bytes(b"head")
    run = tmp_path / "run"
    run.mkdir()
    mtp = {"mtp.0.w": torch.randn(2, 2), "mtp.0.b": torch.randn(2)}
    save_file(mtp, str(run / "mtp.safetensors"))
    (run / "training.json").write_text('{"stage": "drafter"}')

    out = tmp_path / "out"
    done = _run("--base", str(base), "--mtp", str(run / "mtp.safetensors"), "--out", str(out))
    assert done.returncode == 0, done.stderr
    got = load_file(str(out / "model.safetensors"))
    assert torch.equal(got["lm.w"], state["lm.w"])
    assert all(torch.equal(got[k], mtp[k]) for k in mtp)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata()["note"] == "kept"
    assert (out / "confidence" / "model.safetensors").read_bytes() == b"head"
    assert (out / "training.json").read_text() == '{"stage": "drafter"}'
    assert (base / "model.safetensors").is_file() and torch.equal(
        load_file(str(base / "model.safetensors"))["mtp.0.w"], state["mtp.0.w"]
    )

    save_file({"mtp.0.w": torch.randn(2, 3), "mtp.0.b": torch.randn(2)}, str(run / "bad.safetensors"))
    refused = _run("--base", str(base), "--mtp", str(run / "bad.safetensors"), "--out", str(tmp_path / "o2"))
    assert refused.returncode != 0 and "differ" in refused.stderr and not (tmp_path / "o2").exists()
    same = _run("--base", str(base), "--mtp", str(run / "mtp.safetensors"), "--out", str(base))
    assert same.returncode != 0 and "must differ" in same.stderr
