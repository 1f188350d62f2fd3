"""``sluice bench engine --profile --model DIR`` measures a checkpoint's speculative step
profile on the device it runs on and saves it where a DSpark engine on that device loads it
(`services.bench.engine._profile_spec`; on a GPU the file is named after the GPU's model, and
`tests/gpu/test_decode_profile_gpu.py` checks that path)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from engine.spec.profile import SPEC_STEPS_FILE
from services.bench.engine import _profile_spec

MODEL = Path(__file__).resolve().parents[3] / "models" / "trained"


def _checkpoint(tmp_path: Path, **config: object) -> Path:
    """The trained preset's files linked into ``tmp_path`` (the profile is written beside
    them, not into the repository), its config updated with ``config``."""
    model = tmp_path / "trained"
    model.mkdir()
    for f in MODEL.iterdir():
        if f.name != "config.json" and not f.name.startswith("sluice_spec_steps"):
            (model / f.name).symlink_to(f)
    (model / "config.json").write_text(json.dumps(json.loads((MODEL / "config.json").read_text()) | config))
    return model


def test_the_profile_is_saved_where_this_device_s_dspark_engine_loads_it(tmp_path) -> None:
    from engine.core import EngineConfig, EngineCore

    model = _checkpoint(tmp_path)
    args = argparse.Namespace(device="cpu", dtype=None)
    out = _profile_spec(model, args, batches=(1, 2), drafted=2, prompt_tokens=64, warmup=1, steps=2, rounds=1)
    assert out == model / SPEC_STEPS_FILE
    engine = EngineCore(EngineConfig(model=str(model), speculative="dspark"))
    try:
        assert engine.spec is not None and engine.spec.profile is not None
        assert engine.spec.profile.batch == (1, 2) and engine.spec.profile.drafts == (0, 1, 2)
    finally:
        engine.close()


def test_a_checkpoint_without_an_mtp_layer_gets_no_profile(tmp_path) -> None:
    model = _checkpoint(tmp_path, num_nextn_predict_layers=0)
    assert _profile_spec(model, argparse.Namespace(device="cpu", dtype=None)) is None
    assert not list(model.glob("sluice_spec_steps*"))
