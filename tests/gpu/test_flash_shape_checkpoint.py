"""The flash-shape preset (real V4-Flash widths) loads in transformers on a GPU with finite logits."""

import torch

from engine.checkpoint.generate import generate_checkpoint


def test_flash_shape_loads_in_transformers_on_gpu(tmp_path):
    from transformers import DeepseekV4ForCausalLM

    out = generate_checkpoint("flash-shape", tmp_path / "flash", num_hidden_layers=2)
    assert out.num_bytes > 25 * 2**30  # two layers of 256 experts in bf16
    model = DeepseekV4ForCausalLM.from_pretrained(out.path, dtype=torch.bfloat16, device_map="cuda")
    model.eval()
    ids = torch.arange(3, 3 + 300, device="cuda")[None]  # past one HCA window (128) and the SWA window
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 300, 129280)
    assert torch.isfinite(logits).all()
    assert logits.float().std() > 0
