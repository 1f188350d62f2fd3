"""Images: deepseek-recipe preprocessing (`engine.vision`) and the vision encoder (`engine.model.vision`).

The encoder's output rows, ``image_tokens`` and the recipe's token count agree for every
size and detail; the tower equals transformers' ``Siglip2VisionModel``; image keys follow
content, options and encoder; bad images are `ImageRejected`; generated checkpoints carry
an encoder that loads, and the shipped trained preset has none.
"""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from engine.model.vision import (
    VISION_WEIGHTS,
    VisionConfig,
    VisionEncoder,
    image_grid,
    image_tokens,
    load_vision_encoder,
    vision_fingerprint,
)
from engine.vision import DETAILS, ImageRejected, image_key, prepare

MAX_PX, LOW_PX = 8192, 512


def _png(width: int, height: int, seed: int = 0) -> bytes:
    """A cheap-to-encode but non-constant RGB image (gradients plus one seeded pixel)."""
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None]
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :]
    img = np.stack([np.broadcast_to(x, (height, width)), np.broadcast_to(y, (height, width)),
                    np.full((height, width), 77, np.float32)], axis=-1).astype(np.uint8)  # fmt: skip
    img[height // 2, width // 2] = (seed * 37) % 256  # one pixel, mid-image
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "PNG", compress_level=1)
    return buf.getvalue()


def _sizes() -> list[tuple[int, int]]:
    """50 sizes: fixed corner cases (1 px to 6000 px, aspect ratios up to 6000:1) plus seeded
    log-uniform ones."""
    fixed = [(1, 1), (1, 6000), (6000, 1), (2, 3000), (3000, 2), (14, 14), (42, 42), (43, 41),
             (546, 546), (547, 545), (640, 480), (480, 640), (1920, 1080), (1080, 1920), (4000, 3000),
             (5000, 100), (100, 5000), (1302, 1302)]  # fmt: skip
    rng = np.random.default_rng(20260)
    logs = rng.uniform(0.0, math.log(2000), size=(len(fixed) + 32, 2))
    extra = [(int(math.exp(a)) + 1, int(math.exp(b)) + 1) for a, b in logs]
    sizes = list(dict.fromkeys(fixed + extra))[:50]
    assert len(sizes) == 50
    return sizes


@pytest.fixture(scope="module")
def encoder() -> VisionEncoder:
    torch.manual_seed(0)
    cfg = VisionConfig(hidden_size=8, num_layers=1, num_heads=1, intermediate_size=16, text_hidden_size=16)
    return VisionEncoder(cfg).eval()


@pytest.mark.slow  # 200 recipe preprocessings (~11 s): `make test-slow`
def test_token_count_agrees_for_every_size_and_detail(encoder: VisionEncoder) -> None:
    rows_by_size: dict[tuple[int, int], int] = {}  # the encoder's output depends on (W, H) only
    seen_details: dict[str, set[int]] = {d: set() for d in DETAILS}
    for width, height in _sizes():
        data = _png(width, height)
        for detail in DETAILS:
            img = prepare(data, detail, MAX_PX, LOW_PX)
            assert img.pixels.shape == (3, img.height, img.width) and img.pixels.dtype == torch.float32
            size = (img.width, img.height)
            if size not in rows_by_size:
                with torch.no_grad():
                    out = encoder(img.pixels)
                assert out.shape[1] == encoder.config.text_hidden_size
                rows_by_size[size] = out.shape[0]
            counts = (img.num_tokens, rows_by_size[size], image_tokens(img.width, img.height))
            assert counts[0] == counts[1] == counts[2], (width, height, detail, size, counts)
            seen_details[detail].add(img.num_tokens)
    # the sweep covers small and large grids, and low detail is cheaper than high
    assert min(seen_details["low"]) < 200 and max(seen_details["high"]) > 900
    assert max(seen_details["low"]) < max(seen_details["high"])


def test_image_tokens_mapping_worked_example() -> None:
    grid = image_grid(644, 490)  # a 640x480 photo at detail=high
    assert (grid.patch_rows, grid.patch_cols, grid.rows, grid.cols) == (35, 46, 12, 16)
    assert image_tokens(644, 490) == 12 * 17 + 2 == 206
    assert image_tokens(546, 546) == 13 * 14 + 2
    assert image_tokens(42, 28) == 1 * 2 + 2  # a grid of 1x... patches still merges to one cell
    with pytest.raises(ValueError, match="multiple"):
        image_tokens(645, 490)


def test_encoder_layout_begin_newlines_end(encoder: VisionEncoder) -> None:
    with torch.no_grad():
        out = encoder(torch.randn(3, 14 * 7, 14 * 4))  # 7x4 patches -> 3x2 cells
    assert out.shape[0] == 3 * 3 + 2
    assert torch.equal(out[0], encoder.image_begin) and torch.equal(out[-1], encoder.image_end)
    for row in range(3):
        assert torch.equal(out[1 + row * 3 + 2], encoder.image_newline)


@pytest.mark.parametrize("grid", [(5, 7), (13, 20), (8, 8), (2, 31)])
def test_tower_equals_transformers_siglip2(grid: tuple[int, int]) -> None:
    from transformers import Siglip2VisionConfig, Siglip2VisionModel
    from transformers.models.siglip2.image_processing_pil_siglip2 import convert_image_to_patches

    cfg = VisionConfig()  # position grid 8x8: grids above exercise down- and up-sampling
    torch.manual_seed(1)
    enc = VisionEncoder(cfg).eval()
    hf_cfg = Siglip2VisionConfig(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        patch_size=cfg.patch_size,
        num_patches=cfg.position_grid**2,
        layer_norm_eps=cfg.layer_norm_eps,
        vision_use_head=False,
    )
    hf = Siglip2VisionModel(hf_cfg).eval()
    hf.load_state_dict(enc.tower.state_dict(), strict=True)
    gh, gw = grid
    pixels = torch.randn(3, gh * cfg.patch_size, gw * cfg.patch_size)
    with torch.no_grad():
        ours = enc.tower(pixels).reshape(gh * gw, -1)
        ref = hf(
            # transformers' Siglip2 image processor flattens the patches
            pixel_values=torch.from_numpy(convert_image_to_patches(pixels.numpy(), cfg.patch_size))[None],
            pixel_attention_mask=torch.ones(1, gh * gw, dtype=torch.long),
            spatial_shapes=torch.tensor([[gh, gw]]),
        ).last_hidden_state[0]
    assert (ours - ref).abs().max().item() < 1e-5


def test_key_follows_content_detail_and_fingerprint() -> None:
    a = _png(300, 200, seed=1)
    base = prepare(a, "high", MAX_PX, LOW_PX, "enc-1")
    assert len(base.key) == 64 and int(base.key, 16) >= 0
    assert prepare(a, "high", MAX_PX, LOW_PX, "enc-1").key == base.key  # stable
    assert prepare(_png(300, 200, seed=2), "high", MAX_PX, LOW_PX, "enc-1").key != base.key  # one pixel
    assert prepare(a, "low", MAX_PX, LOW_PX, "enc-1").key != base.key
    assert prepare(a, "high", MAX_PX, LOW_PX, "enc-2").key != base.key
    assert prepare(a, "high", MAX_PX, 256, "enc-1").key != base.key
    # every byte counts, the last one too, and bytes do not move between parts unnoticed
    assert image_key(a, "high", MAX_PX, LOW_PX, "enc-1") == base.key
    assert image_key(a[:-1] + bytes([a[-1] ^ 1]), "high", MAX_PX, LOW_PX, "enc-1") != base.key
    assert image_key(a + b"e", "high", MAX_PX, LOW_PX, "nc-1") != base.key


def test_pixels_are_normalised_rgb() -> None:
    img = prepare(_png(600, 600), "high", MAX_PX, LOW_PX)
    assert img.pixels.min() >= -1.0 and img.pixels.max() <= 1.0
    # channel 2 is constant 77 in the source: (77/255 - 0.5) / 0.5, up to the recipe's lossy WebP
    assert abs(img.pixels[2].mean().item() - (77 / 255 * 2 - 1)) < 0.02
    # channel 0 grows left to right, channel 1 top to bottom (RGB order, not BGR; not transposed)
    assert img.pixels[0, :, -1].mean() > img.pixels[0, :, 0].mean() + 1.5
    assert img.pixels[1, -1, :].mean() > img.pixels[1, 0, :].mean() + 1.5


def _not_an_image() -> bytes:
    return b"GIF89a? no, just text pretending to be an image" * 10


@pytest.mark.parametrize(
    "data",
    [pytest.param(lambda: _png(400, 300)[:600], id="truncated-png"),
     pytest.param(lambda: b"", id="zero-bytes"),
     pytest.param(_not_an_image, id="not-an-image"),
     pytest.param(lambda: b"%PDF-1.7\n" + bytes(range(256)) * 4, id="pdf")],
)  # fmt: skip
def test_bad_images_are_rejected(data) -> None:
    with pytest.raises(ImageRejected) as err:
        prepare(data(), "auto", MAX_PX, LOW_PX)
    assert isinstance(err.value, ValueError)
    assert "image" in str(err.value) and err.value.kind != "Unknown"


def test_oversized_and_bad_detail_are_rejected_with_a_hint() -> None:
    with pytest.raises(ImageRejected, match="at most 1000 px"):
        prepare(_png(1200, 50), "high", 1000, LOW_PX)
    with pytest.raises(ImageRejected, match="low, high, original, auto"):
        prepare(_png(50, 50), "medium", MAX_PX, LOW_PX)


def test_generated_checkpoints_carry_a_loadable_encoder(checkpoint_factory) -> None:
    path = checkpoint_factory("tiny")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["vision"]["text_hidden_size"] == cfg["hidden_size"]
    assert (path / VISION_WEIGHTS).is_file()
    enc = load_vision_encoder(path)
    assert enc is not None and enc.config == VisionConfig.from_dict(cfg["vision"])
    assert VisionConfig.from_dict(enc.config.to_dict()) == enc.config
    with torch.no_grad():
        out = enc(torch.zeros(3, 546, 546))
    assert out.shape == (image_tokens(546, 546), cfg["hidden_size"]) and torch.isfinite(out).all()
    assert len(vision_fingerprint(path)) == 64


def test_the_encoder_loads_the_files_tensors_without_random_init_or_dynamo(checkpoint_factory) -> None:
    """The load builds the encoder with torch's init functions switched off (its tensors come
    from the file): they are restored afterwards, every tensor equals the file's, and a fresh
    process that loads it never imports torch._dynamo (which the init's meta-device fills did)."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    path = checkpoint_factory("tiny")
    inits = {
        name: getattr(torch.nn.init, name) for name in ("normal_", "uniform_", "kaiming_uniform_", "ones_")
    }
    enc = load_vision_encoder(path)
    assert {name: getattr(torch.nn.init, name) for name in inits} == inits
    saved = load_file(str(path / VISION_WEIGHTS))
    assert len(saved) == len(enc.state_dict())
    for name, t in enc.state_dict().items():
        assert torch.equal(t, saved["vision." + name]), name
    probe = (
        "import sys; from engine.model.vision import load_vision_encoder; "
        f"load_vision_encoder({str(path)!r}); print('torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_checkpoints_without_vision_have_no_encoder(tmp_path) -> None:
    from engine.checkpoint.generate import generate_checkpoint
    from engine.checkpoint.presets import SHIPPED

    assert load_vision_encoder(SHIPPED["trained"]) is None
    assert vision_fingerprint(SHIPPED["trained"]) == ""
    out = generate_checkpoint("tiny", tmp_path / "novision", vision=False)
    assert out.vision_files == () and load_vision_encoder(out.path) is None
    assert not (out.path / VISION_WEIGHTS).exists()


def test_config_rejects_a_grid_the_recipe_does_not_use() -> None:
    with pytest.raises(ValueError, match="specification fixes 14 and 3"):
        VisionConfig(patch_size=16)
    with pytest.raises(ValueError, match="unknown vision config keys"):
        VisionConfig.from_dict({"hidden_sise": 8})
