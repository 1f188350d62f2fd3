"""The vision encoder: a SigLIP2 ViT tower plus a 3x3-merge projector into the LM's hidden size.

Its output has exactly one row per prompt token the image occupies under deepseek-recipe's
V4.1 image token specification: no row is padded or dropped to make the counts agree.

The recipe's rule (deepseek-recipe 0.2.0, probed over every detail and ~2,000 sizes from
1x1 to 6000x6000): the preprocessor resizes each image to ``W x H`` px, both multiples of 14,
and the image then takes ::

    tokens(W, H) = ceil(H / 42) * (ceil(W / 42) + 1) + 2

prompt tokens. This module produces exactly that layout:

1. **Patches.** ``pixels [3, H, W]`` -> a ``gh x gw`` grid of 14x14 patches
   (``gh = H / 14``, ``gw = W / 14``); every pixel lies in exactly one patch.
2. **Tower** (SigLIP2, transformers' ``Siglip2VisionModel`` without the pooling head): linear
   patch embedding, learned ``position_grid x position_grid`` position embeddings resized
   to ``gh x gw`` (bilinear, antialiased, as transformers does), pre-LN transformer blocks
   (full bidirectional attention over the ``gh * gw`` patches), post-LN.
3. **Merge** (DeepSeek-VL2's downsample projector, with a 3x3 window): the feature grid is
   extended at the bottom/right with zero features to ``3 * ceil(gh / 3) x 3 * ceil(gw / 3)``
   and each 3x3 window's nine features (row-major, concatenated) go through
   Linear -> GELU -> Linear into ``text_hidden_size``: ``rows = ceil(gh / 3)`` by
   ``cols = ceil(gw / 3)`` cells. (Since 14 divides ``H``, ``ceil(gh / 3) = ceil(H / 42)``.)
4. **Layout** (learned embeddings for the special rows)::

       image_begin, row 0 (cols cells), image_newline, ..., row rows-1, image_newline, image_end

   = ``rows * (cols + 1) + 2`` rows.

Worked example: a 640x480 photo at ``detail="high"`` is resized by the recipe to 644x490 px
-> ``gh x gw = 35 x 46`` patches (1,610 tower tokens) -> ``12 x 16`` merged cells ->
``12 * (16 + 1) + 2 = 206`` rows, the recipe's count for it.

Weights live in the checkpoint directory: config.json's ``vision`` section is a
`VisionConfig` (`VisionConfig.to_dict`), and ``vision/model.safetensors`` holds the tensors
under ``vision.`` + this module's state-dict names (``vision.tower.*`` are transformers'
``Siglip2VisionModel`` names). The subdirectory keeps them out of the language model's
shard set, so the LM loaders (Sluice's and transformers') never see them.
`load_vision_encoder` reads them; a checkpoint without a ``vision`` section has no encoder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Final

import torch
import torch.nn.functional as F
from torch import nn

#: The V4.1 image token specification's patch size and merge window (deepseek-recipe).
SPEC_PATCH_SIZE: Final = 14
SPEC_MERGE: Final = 3
#: Where a checkpoint keeps its vision weights, relative to the checkpoint directory.
VISION_WEIGHTS: Final = "vision/model.safetensors"
#: Prefix of every vision tensor name in that file.
VISION_PREFIX: Final = "vision."


@dataclass(frozen=True)
class ImageGrid:
    """How one ``width x height`` image maps to tokens (see the module docstring)."""

    patch_rows: int  # gh = height / patch_size
    patch_cols: int  # gw = width / patch_size
    rows: int  # ceil(gh / merge)
    cols: int  # ceil(gw / merge)

    @property
    def num_tokens(self) -> int:
        """Merged cells, one newline per row, begin and end."""
        return self.rows * (self.cols + 1) + 2


def image_grid(
    width: int, height: int, patch_size: int = SPEC_PATCH_SIZE, merge: int = SPEC_MERGE
) -> ImageGrid:
    """The patch and merged grids of a preprocessed ``width x height`` image.

    Raises ValueError unless both sides are positive multiples of ``patch_size`` (what
    `engine.vision.prepare` produces).
    """
    if width <= 0 or height <= 0 or width % patch_size or height % patch_size:
        raise ValueError(
            f"image size {width}x{height} is not a positive multiple of the {patch_size}-px patch "
            "on both sides; preprocess it with engine.vision.prepare"
        )
    gh, gw = height // patch_size, width // patch_size
    return ImageGrid(gh, gw, -(-gh // merge), -(-gw // merge))


def image_tokens(width: int, height: int) -> int:
    """Prompt tokens of a preprocessed ``width x height`` image: ``ceil(H/42) * (ceil(W/42) + 1) + 2``.

    Pure; equals deepseek-recipe's V4.1 count and `VisionEncoder`'s output rows.
    """
    return image_grid(width, height).num_tokens


@dataclass(frozen=True)
class VisionConfig:
    """Shape of a `VisionEncoder`. The defaults are a tiny encoder for tests.

    ``patch_size`` and ``merge`` are fixed by the V4.1 token specification (14 and 3);
    ``position_grid`` is the side of the learned position-embedding grid (SigLIP2's
    ``sqrt(num_patches)``); ``text_hidden_size`` is the language model's ``hidden_size``;
    ``projector_hidden_size`` the merge MLP's width (0: ``text_hidden_size``).
    """

    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 2
    intermediate_size: int = 64
    patch_size: int = SPEC_PATCH_SIZE
    merge: int = SPEC_MERGE
    position_grid: int = 8
    text_hidden_size: int = 64
    projector_hidden_size: int = 0
    layer_norm_eps: float = 1e-6
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    def __post_init__(self) -> None:
        if (self.patch_size, self.merge) != (SPEC_PATCH_SIZE, SPEC_MERGE):
            raise ValueError(
                f"patch_size={self.patch_size}, merge={self.merge}: the V4.1 image token "
                f"specification fixes {SPEC_PATCH_SIZE} and {SPEC_MERGE} (token counts would disagree)"
            )
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size", "position_grid"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.text_hidden_size < 1 or self.projector_hidden_size < 0:
            raise ValueError("text_hidden_size must be >= 1 and projector_hidden_size >= 0")
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or min(self.image_std) <= 0:
            raise ValueError("image_mean and image_std need 3 values each, std > 0")

    @property
    def projector_width(self) -> int:
        return self.projector_hidden_size or self.text_hidden_size

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["image_mean"], d["image_std"] = list(self.image_mean), list(self.image_std)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VisionConfig:
        """Build from a config.json ``vision`` section; unknown keys are an error (typos)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown vision config keys {unknown}; known: {sorted(known)}")
        kw = dict(d)
        for k in ("image_mean", "image_std"):
            if k in kw:
                kw[k] = tuple(float(x) for x in kw[k])
        return cls(**kw)


class _Embeddings(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Linear(3 * cfg.patch_size**2, cfg.hidden_size)
        self.position_embedding = nn.Embedding(cfg.position_grid**2, cfg.hidden_size)
        self.grid = cfg.position_grid

    def positions(self, gh: int, gw: int) -> torch.Tensor:
        """The learned grid resized to ``gh x gw`` -> ``[gh * gw, D]`` (transformers' resize:
        bilinear, align_corners=False, antialiased, computed in fp32)."""
        table = self.position_embedding.weight
        grid = table.float().reshape(self.grid, self.grid, -1).permute(2, 0, 1)[None]
        resized = F.interpolate(grid, size=(gh, gw), mode="bilinear", align_corners=False, antialias=True)
        return resized[0].flatten(1).t().to(table.dtype)

    def forward(self, patches: torch.Tensor, gh: int, gw: int) -> torch.Tensor:
        return self.patch_embedding(patches) + self.positions(gh, gw)


class _Attention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.heads = cfg.num_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, D], one image: full attention
        n, d = x.shape
        q, k, v = (
            p(x).view(n, self.heads, -1).transpose(0, 1) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q[None], k[None], v[None])[0]
        return self.out_proj(out.transpose(0, 1).reshape(n, d))


class _MLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))  # SigLIP's gelu_pytorch_tanh


class _Block(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = _Attention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = _MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block(cfg) for _ in range(cfg.num_layers))


class SiglipTower(nn.Module):
    """SigLIP2's vision transformer on one image; state-dict names equal transformers'
    ``Siglip2VisionModel`` (``vision_use_head=False``), so its weights load either way."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.patch_size = cfg.patch_size
        self.embeddings = _Embeddings(cfg)
        self.encoder = _Encoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def patchify(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[3, H, W]`` -> ``[gh * gw, p * p * 3]``, row-major patches, each (row, col, channel)
        ordered as transformers' Siglip2 image processor flattens them."""
        c, h, w = pixels.shape
        p = self.patch_size
        x = pixels.reshape(c, h // p, p, w // p, p).permute(1, 3, 2, 4, 0)
        return x.reshape((h // p) * (w // p), p * p * c)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[3, H, W]`` -> ``[gh, gw, D]`` post-LN patch features."""
        gh, gw = pixels.shape[1] // self.patch_size, pixels.shape[2] // self.patch_size
        x = self.embeddings(self.patchify(pixels), gh, gw)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x).view(gh, gw, -1)


class MergeProjector(nn.Module):
    """3x3 windows of tower features (zero-extended at the bottom/right edge) -> LM hidden size."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.merge = cfg.merge
        self.fc1 = nn.Linear(cfg.merge**2 * cfg.hidden_size, cfg.projector_width)
        self.fc2 = nn.Linear(cfg.projector_width, cfg.text_hidden_size)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        """``[gh, gw, D]`` -> ``[ceil(gh/m), ceil(gw/m), text_hidden]``."""
        gh, gw, d = feats.shape
        m = self.merge
        rows, cols = -(-gh // m), -(-gw // m)
        x = F.pad(feats, (0, 0, 0, cols * m - gw, 0, rows * m - gh))
        x = x.view(rows, m, cols, m, d).permute(0, 2, 1, 3, 4).reshape(rows, cols, m * m * d)
        return self.fc2(F.gelu(self.fc1(x)))


def random_init(name: str, shape: tuple[int, ...], generator: torch.Generator | None = None) -> torch.Tensor:
    """A random fp32 value for the `VisionEncoder` parameter ``name``: LayerNorm scales near 1,
    projections with unit-variance outputs, small biases, unit-variance embeddings."""
    r = torch.randn(shape, generator=generator, dtype=torch.float32)
    if name.endswith(("layer_norm1.weight", "layer_norm2.weight", "post_layernorm.weight")):
        return 1.0 + 0.1 * r
    if len(shape) == 2 and "position_embedding" not in name:
        return r / math.sqrt(shape[1])
    if len(shape) == 1 and not name.startswith("image_"):
        return 0.02 * r
    return r  # position embeddings, image_begin / image_newline / image_end


class VisionEncoder(nn.Module):
    """``pixels [3, H, W]`` (from `engine.vision.prepare`) -> ``[image_tokens(W, H), text_hidden]``."""

    def __init__(self, cfg: VisionConfig | None = None) -> None:
        super().__init__()
        self.config = cfg = cfg or VisionConfig()
        self.tower = SiglipTower(cfg)
        self.projector = MergeProjector(cfg)
        t = cfg.text_hidden_size
        self.image_begin = nn.Parameter(torch.zeros(t))
        self.image_newline = nn.Parameter(torch.zeros(t))
        self.image_end = nn.Parameter(torch.zeros(t))
        self.reset_parameters()

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Random weights (a stand-in until trained ones exist), reproducible with ``generator``."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.device.type != "meta":
                    p.copy_(random_init(name, tuple(p.shape), generator))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        if pixels.dim() != 3 or pixels.shape[0] != 3:
            raise ValueError(f"pixels must be [3, H, W], got {tuple(pixels.shape)}")
        grid = image_grid(
            int(pixels.shape[2]), int(pixels.shape[1]), self.config.patch_size, self.config.merge
        )
        ref = self.image_begin
        cells = self.projector(self.tower(pixels.to(device=ref.device, dtype=ref.dtype)))
        newline = self.image_newline.expand(grid.rows, 1, -1)
        body = torch.cat([cells, newline], dim=1).reshape(grid.rows * (grid.cols + 1), -1)
        out = torch.cat([self.image_begin[None], body, self.image_end[None]])
        assert out.shape[0] == grid.num_tokens  # the layout itself, never adjusted
        return out


def load_vision_encoder(
    model_dir: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> VisionEncoder | None:
    """The checkpoint's vision encoder, or None when its config.json has no ``vision`` section.

    Reads `VISION_WEIGHTS` (safetensors, keys ``vision.*``); every encoder tensor must be
    there with its shape (ValueError otherwise; FileNotFoundError without the file).
    """
    from safetensors import safe_open

    root = Path(model_dir)
    section = json.loads((root / "config.json").read_text()).get("vision")
    if not section:
        return None
    cfg = VisionConfig.from_dict(section)
    path = root / VISION_WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(f"{root}: config.json has a vision section but {VISION_WEIGHTS} is missing")
    with torch.device("meta"), _parameters_uninitialised():
        enc = VisionEncoder(cfg)
    want = enc.state_dict()
    state: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())  # noqa: SIM118 - safe_open handles are not mappings
        expected = {VISION_PREFIX + k for k in want}
        if names != expected:
            missing, extra = sorted(expected - names), sorted(names - expected)
            raise ValueError(f"{path}: missing tensors {missing[:5]}, unexpected tensors {extra[:5]}")
        for name, ref in want.items():
            t = f.get_tensor(VISION_PREFIX + name)
            if t.shape != ref.shape:
                raise ValueError(f"{path}: {name} has shape {tuple(t.shape)}, expected {tuple(ref.shape)}")
            state[name] = t.to(dtype)
    enc.load_state_dict(state, assign=True)
    return enc.to(device=device, dtype=dtype).eval()


_INIT_FUNCTIONS: Final = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "kaiming_uniform_",
    "ones_",
    "zeros_",
    "constant_",
)
_init_lock = threading.Lock()


@contextlib.contextmanager
def _parameters_uninitialised() -> Iterator[None]:
    """Modules built inside skip ``torch.nn.init``'s random fills: their tensors are replaced
    by the checkpoint's. On the meta device those fills run through torch's Python references,
    whose first call imports ``torch._dynamo`` (2.3-2.6 s of CPU on the 2-core VM, in an
    engine process that otherwise never loads it). The functions are swapped module-wide
    for the block, as transformers' ``no_init_weights`` does, so loads are serialised."""
    with _init_lock:
        saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
        try:
            for name in _INIT_FUNCTIONS:
                setattr(nn.init, name, _unchanged)
            yield
        finally:
            for name, fn in saved.items():
                setattr(nn.init, name, fn)


def _unchanged(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor


def vision_fingerprint(model_dir: str | Path) -> str:
    """Hex SHA-256 of the encoder's identity: the canonical ``vision`` config and the weight
    file's bytes ("" without a vision section). Pass it to `engine.vision.prepare` as
    ``encoder_fingerprint`` so image keys change when the encoder does."""
    root = Path(model_dir)
    section = json.loads((root / "config.json").read_text()).get("vision")
    if not section:
        return ""
    h = hashlib.sha256(b"sluice-vision-v1\0")
    h.update(json.dumps(section, sort_keys=True, separators=(",", ":")).encode() + b"\0")
    with open(root / VISION_WEIGHTS, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()
