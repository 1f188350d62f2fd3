"""FP8 block-scaled linears and FP4 experts: format round trips, and quantised checkpoints load
into Sluice with the same logits as the transformers reference holding the dequantised weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.checkpoint.quant import (
    dequantize,
    find_scale,
    is_scale_key,
    quantize_checkpoint,
    quantize_fp4,
    quantize_fp8,
)
from engine.forward_batch import ForwardBatch, SequenceInput
from engine.runner import ModelRunner, RunnerConfig
from tests.unit.engine.conftest import reference_logits


def test_fp4_round_trip_is_exact_on_representable_values() -> None:
    vals = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    g = torch.cat([vals, -vals, vals, -vals])  # one 32-value group
    w = torch.cat([g, g * 0.25]).view(1, 64).repeat(3, 1)  # second group needs scale 2^-2
    q, s = quantize_fp4(w)
    assert q.dtype == torch.int8 and q.shape == (3, 32) and s.shape == (3, 2)
    assert s.dtype == torch.float8_e8m0fnu
    assert torch.equal(dequantize(q, s), w)


def test_fp8_blocks_cover_ragged_shapes_within_e4m3_precision() -> None:
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(0))
    w[:128, :128] *= 100  # one block with a much larger range must not hurt the others
    for ue8m0 in (True, False):
        q, s = quantize_fp8(w, ue8m0)
        assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 3)
        err = (dequantize(q, s) - w).abs()
        assert err[128:, 128:].max() < 0.2 and err[:128, :128].max() < 20  # 3 mantissa bits


def _dequantized_copy(qdir: Path, out: Path) -> Path:
    out.mkdir()
    for f in qdir.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            keys = list(h.keys())  # noqa: SIM118
            src = {k: h.get_tensor(k) for k in keys}
        plain = {}
        for k, t in src.items():
            if is_scale_key(src, k):
                continue
            sk = find_scale(src, k)
            plain[k] = (dequantize(t, src[sk]) if sk else t).contiguous()
        save_file(plain, str(out / f.name))
    cfg = json.loads((qdir / "config.json").read_text())
    cfg.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("mode", ["fp8", "fp4"])
def test_quantized_checkpoint_matches_dequantized_reference(reference, tmp_path: Path, mode: str) -> None:
    from transformers import DeepseekV4ForCausalLM

    path, ref = reference("mixed_hc2")
    qdir = quantize_checkpoint(path, tmp_path / "q", mode)
    with safe_open(str(qdir / "model.safetensors"), framework="pt") as h:
        dtypes = {k: h.get_slice(k).get_dtype() for k in h.keys()}  # noqa: SIM118
    assert dtypes["model.layers.0.attn.wq_a.weight"] == "F8_E4M3"
    assert dtypes["model.layers.0.ffn.experts.0.w1.weight"] == ("I8" if mode == "fp4" else "F8_E4M3")
    deq = DeepseekV4ForCausalLM.from_pretrained(_dequantized_copy(qdir, tmp_path / "d"), dtype=torch.float32)
    deq.config._experts_implementation = "eager"
    deq.eval()
    ids = torch.randint(0, 256, (90,), generator=torch.Generator().manual_seed(5))
    want = reference_logits(deq, ids)
    runner = ModelRunner(qdir, RunnerConfig(num_blocks=2, num_slots=1))
    got = runner.execute(ForwardBatch.from_sequences([SequenceInput(ids.tolist(), 0, 0, [0])])).logits[0]
    assert (got - want[-1]).abs().max().item() < 1e-4
    # the quantisation is real: the unquantised model gives different logits
    assert (got - reference_logits(ref, ids)[-1]).abs().max().item() > 1e-3


@pytest.mark.parametrize("quant", ["fp8", "fp4"])
def test_weights_kept_quantised_give_the_same_logits_in_less_memory(checkpoint_factory, quant: str) -> None:
    from engine.model.qlinear import QuantLinear

    path = checkpoint_factory("tiny", quant=quant, hidden_size=128, moe_intermediate_size=64)
    ids = list(range(9, 80))
    batch = ForwardBatch.from_sequences([SequenceInput(ids, 0, 0, [0])])
    runners = [
        ModelRunner(path, RunnerConfig(num_blocks=2, num_slots=1, keep_quantized=k)) for k in (False, True)
    ]
    dense, kept = (r.execute(batch).logits[0] for r in runners)
    assert (dense - kept).abs().max().item() < 1e-5
    model = runners[1].model
    assert isinstance(model.model.layers[0].self_attn.q_a_proj, QuantLinear)
    assert model.model.layers[1].mlp.experts.quantized == {"gate_up_proj", "down_proj"}

    def nbytes(m: torch.nn.Module) -> int:
        return sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])

    assert nbytes(model) < 0.6 * nbytes(runners[0].model)
