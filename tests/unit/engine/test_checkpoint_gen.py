"""`sluice gen-checkpoint` writes checkpoints transformers' DeepSeek-V4 loads, with a usable tokenizer."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from engine.checkpoint.generate import generate_checkpoint
from engine.checkpoint.presets import preset_config


def _hf_logits(path, ids):
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(path)
    model.eval()
    with torch.no_grad():
        return model, model(torch.tensor([ids])).logits


# small: the same code on a bigger preset, in `make test-slow`
@pytest.mark.parametrize("preset", ["tiny", pytest.param("small", marks=pytest.mark.slow)])
def test_preset_loads_in_transformers_with_finite_logits(checkpoint_factory, preset):
    path = checkpoint_factory(preset)
    model, logits = _hf_logits(path, list(range(3, 300)))
    assert logits.shape[-1] == json.loads((path / "config.json").read_text())["vocab_size"]
    assert torch.isfinite(logits).all()
    # every tensor transformers expects came from the file (nothing left at its own init)
    with safe_open(path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert set(model.state_dict()) <= keys


def test_tiny_covers_every_component(checkpoint_factory):
    path = checkpoint_factory("tiny")
    cfg = json.loads((path / "config.json").read_text())
    assert set(cfg["layer_types"]) == {
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    }
    assert "hash_moe" in cfg["mlp_layer_types"] and "moe" in cfg["mlp_layer_types"]
    assert cfg["hc_mult"] >= 2 and cfg["num_nextn_predict_layers"] == 1
    with safe_open(path / "model.safetensors", "pt") as f:
        keys = list(f.keys())
        n_params = sum(
            f.get_slice(k).get_shape().numel()
            if hasattr(f.get_slice(k).get_shape(), "numel")
            else int(torch.tensor(f.get_slice(k).get_shape()).prod())
            for k in keys
        )
        assert any(k.startswith("mtp.0.e_proj") for k in keys)
        assert any(k.startswith("mtp.0.self_attn.") for k in keys)
        # transformers zero-initialises these; ours must not be zero
        for suffix in ("sinks", "position_bias", "e_score_correction_bias", "tid2eid"):
            tensors = [f.get_tensor(k) for k in keys if k.endswith(suffix)]
            assert tensors, suffix
            assert all(t.abs().sum() > 0 for t in tensors), suffix
        tid2eid = next(f.get_tensor(k) for k in keys if k.endswith("tid2eid"))
    assert n_params < 1_000_000
    # hash routing picks distinct experts per token
    assert all(len(set(row.tolist())) == tid2eid.shape[1] for row in tid2eid[:64])


def test_generation_is_deterministic_per_seed(tmp_path):
    a = generate_checkpoint("tiny", tmp_path / "a", seed=7)
    b = generate_checkpoint("tiny", tmp_path / "b", seed=7)
    c = generate_checkpoint("tiny", tmp_path / "c", seed=8)
    read = lambda p: (p / "model.safetensors").read_bytes()  # noqa: E731
    assert read(a.path) == read(b.path)
    assert read(a.path) != read(c.path)


def test_sharded_output_loads(tmp_path, checkpoint_factory):
    out = generate_checkpoint("tiny", tmp_path / "sharded", shard_bytes=256 * 1024)
    assert len(out.files) > 1
    index = json.loads((out.path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(out.files)
    ids = list(range(3, 200))
    _, sharded = _hf_logits(out.path, ids)
    _, single = _hf_logits(checkpoint_factory("tiny"), ids)
    torch.testing.assert_close(sharded, single, rtol=0, atol=0)


def test_flash_shape_config_has_v4_flash_widths():
    cfg = preset_config("flash-shape")
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]) == (4096, 64, 512)
    assert (cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"]) == (1024, 8, 1024)
    assert (cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == (
        256,
        6,
        2048,
    )
    assert (cfg["sliding_window"], cfg["hc_mult"]) == (128, 4)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_flash_shape_loads_in_transformers(tmp_path):
    """Real V4-Flash widths, one layer (13 GB of experts in bf16 per layer: slow suite only)."""
    cfg = preset_config("flash-shape")
    # the bf16 experts of one layer, plus as much again for the rest and for headroom
    need = 2 * 2 * 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"] * cfg["n_routed_experts"]
    free = shutil.disk_usage(tmp_path).free
    if free < need:
        pytest.skip(f"needs ~{need / 1e9:.0f} GB free under {tmp_path}, has {free / 1e9:.0f} GB")
    out = generate_checkpoint("flash-shape", tmp_path / "flash", num_hidden_layers=1)
    _, logits = _hf_logits(out.path, list(range(3, 140)))
    assert torch.isfinite(logits).all()


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match="flash-shape, small, tiny"):
        preset_config("huge")
