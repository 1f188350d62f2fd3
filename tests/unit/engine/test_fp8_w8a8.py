"""FP8 weights times FP8-quantised activations (``fp8_compute='w8a8'``, `engine.kernels.fp8`):
the activation quantiser's rule, the eager path every device runs (the CUDA kernels are
compared with it in tests/gpu/test_kernels.py), and the engine's settings and cache identity."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.checkpoint.generate import write_config_dir
from engine.checkpoint.presets import preset_config
from engine.checkpoint.quant import dequantize, quantize_fp8
from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.forward_batch import ForwardBatch, SequenceInput
from engine.kernels import fp8
from engine.model.qlinear import QuantLinear
from engine.runner import ModelRunner, RunnerConfig


@pytest.fixture
def w8a8():
    fp8.set_compute("w8a8")
    try:
        yield
    finally:
        fp8.set_compute("w8a16")


def test_the_row_quantiser_uses_power_of_two_scales_and_rounds_once() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 384, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 1e4, 1.0, 0.0])[:, None]
    x[4, 130] = 900.0  # one outlier sets its block's scale only
    q, s = fp8.quantize_rows_reference(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and s.shape == (6, 3)
    mant, _ = torch.frexp(s)
    assert torch.all(mant == 0.5)  # ue8m0: powers of two
    blocks = x.view(6, 3, 128)
    amax = blocks.abs().amax(-1).clamp(min=fp8.AMAX_FLOOR)
    assert torch.all(s >= amax / fp8.E4M3_MAX) and torch.all(s < 2 * amax / fp8.E4M3_MAX)
    deq = q.float().view(6, 3, 128) * s[..., None]
    # e4m3's rounding only: 2**-4 relative for normals, half a subnormal step (2**-10 s) below
    err = (deq - blocks).abs()
    assert torch.all(err <= torch.maximum(blocks.abs() * 2.0**-4, s[..., None] * 2.0**-10))
    assert torch.equal(deq[5], torch.zeros(3, 128))  # zero rows stay zero
    assert s[4, 1] > 100 * s[4, 0]  # the outlier's block only
    xb = x.bfloat16()
    qb, sb = fp8.quantize_rows_reference(xb)
    want = (qb.float().view(6, 3, 128) * sb[..., None]).view(6, 384)
    assert torch.equal(fp8.fake_quantize_rows(xb).float(), want)  # e4m3 x 2**e: exact in bf16
    with pytest.raises(ValueError, match="128-column blocks"):
        fp8.quantize_rows_reference(torch.ones(2, 100))


def test_the_power_of_two_ceiling_is_exact() -> None:
    v = torch.tensor([1.0, 0.75, 2.0**-20, 3.0, 2.0**10 + 1, 448.0])
    assert fp8._pow2_ceil(v).tolist() == [1.0, 1.0, 2.0**-20, 4.0, 2.0**11, 512.0]


def test_an_fp8_linear_quantises_its_activations_under_w8a8(w8a8) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(256, 384, generator=g) * 0.05
    qw, sw = quantize_fp8(w)
    lin = QuantLinear(qw, sw)
    x = torch.randn(5, 384, generator=g)
    want = F.linear(fp8.fake_quantize_rows(x), dequantize(qw, sw))
    assert torch.equal(lin(x), want)
    fp8.set_compute("w8a16")
    plain = lin(x)
    # e4m3's 3 mantissa bits: a few percent of the output's norm
    assert 0 < ((plain - want).norm() / plain.norm()).item() < 0.06
    # widths that are not whole 128-column blocks keep bf16 activations in both modes
    narrow = QuantLinear(*quantize_fp8(torch.randn(64, 96, generator=g)))
    y = torch.randn(3, 96, generator=g)
    fp8.set_compute("w8a8")
    assert not fp8.quantizes_activations(y, narrow.qweight) and torch.equal(
        narrow(y), F.linear(y, dequantize(narrow.qweight, narrow.scale))
    )


def test_a_w8a8_runner_computes_close_to_w8a16(w8a8) -> None:
    """Every FP8 product of the `small` preset (widths of whole 128-blocks: experts, attention
    projections, grouped o_a) quantises its activations: logits move by the activations'
    rounding, far less than another seed's weights move them."""
    mc = ModelConfig.from_dict(preset_config("small", num_hidden_layers=2))
    ids = list(range(3, 60))
    batch = ForwardBatch.from_sequences([SequenceInput(ids, 0, 0, [0])])

    def logits(seed: int, compute: str) -> torch.Tensor:
        fp8.set_compute(compute)
        cfg = RunnerConfig(num_blocks=8, num_slots=2, with_mtp=False, fp8_compute=compute)
        return ModelRunner.random(mc, cfg, seed=seed, fp8=True).execute(batch).logits

    a8, a16, other = logits(3, "w8a8"), logits(3, "w8a16"), logits(4, "w8a16")
    rel = ((a8 - a16).norm() / a16.norm()).item()
    assert 0 < rel < 0.1 and rel < 0.2 * ((other - a16).norm() / a16.norm()).item()


def test_w8a8_is_an_fp8_setting_with_its_own_cache_identity(tmp_path, w8a8) -> None:
    model = write_config_dir("small", tmp_path / "small", num_hidden_layers=2)
    with pytest.raises(ValueError, match="keep_quantized"):
        EngineConfig(model=str(model), fp8_compute="w8a8")
    with pytest.raises(ValueError, match="fp8_compute"):
        EngineConfig(model=str(model), keep_quantized=True, fp8_compute="fp4")
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prints = []
    for compute in ("w8a16", "w8a8"):
        fp8.set_compute("w8a16")
        kw = dict(random_weights=7, keep_quantized=True, fp8_compute=compute)
        with LLM(model, num_blocks=8, num_swa_slots=2, max_num_seqs=2, **kw) as llm:
            out = llm.generate(prompt_token_ids=[[0, 5, 6, 7]], sampling_params=greedy)
            assert len(out[0].outputs[0].token_ids) == 3
            prints.append(llm.core.fingerprint)
    assert prints[0] != prints[1]  # quantised activations compute other caches
