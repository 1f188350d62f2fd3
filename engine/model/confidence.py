"""Draft confidence head (DSpark speculative decoding): how likely the MTP layer's draft is accepted.

For draft ``k`` (``k = 1 .. 5``, one MTP pass each)::

    p_k = sigmoid(w . [h_k ; e_k] + b)        w: [2D], b: scalar (``Linear(2D -> 1)``)

* ``h_k`` [D]: the MTP pass's final hidden state at the draft's position, the tensor the
  draft logits are read from: ``layer.norm(layer.hc_head(out))`` where ``out`` is the MTP
  layer's output streams [hc, D] (``DeepseekV4.forward_mtp``; ``lm_head(h_k)`` are the draft
  logits, ``argmax`` the draft token).
* ``e_k`` [D]: the shared ``model.embed_tokens`` row of the token the pass was fed, i.e. the
  previous draft token (for draft 1: the token the target just produced). It is the same
  ``next_ids`` the MTP pass embeds for its input.

A head may read two more groups of inputs, appended in this order (`ConfidenceConfig`):

* ``softmax`` (3): of the draft distribution ``log_softmax(lm_head(h_k))`` the drafter computes
  anyway to take its argmax: the log of its top probability, the log-ratio of its top two,
  and its entropy (`softmax_features`). They are functions of ``h_k`` a linear map of
  ``h_k`` cannot form.
* ``position`` (``positions``): the one-hot of the draft's position ``k`` (``k <= positions``),
  i.e. a bias per position.

``p_k`` estimates the probability that draft ``k`` equals the target's token *given every
earlier draft of the step was accepted* (how it was trained: ``engine/train/confidence.py``),
so ``p_1 * ... * p_k`` estimates that the first ``k`` drafts are all accepted.

The head ships beside a checkpoint in its own file, ``confidence/model.safetensors`` (fp32:
``confidence.weight`` [1, 2D], or [1, 2D + 3] for a head reading ``softmax``;
``confidence.bias`` [1]; and ``confidence.position`` [positions], the per-position bias, only
for a head reading ``position``: the shapes say which inputs it reads), so the main weight
shards stay exactly what transformers loads; ``confidence/confidence.json`` beside it records
how it was trained and how well it is calibrated. ``D`` is config.json's ``hidden_size``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from engine.model.model import DeepseekV4

CONFIDENCE_DIR: Final = "confidence"
CONFIDENCE_WEIGHTS: Final = "confidence/model.safetensors"
CONFIDENCE_REPORT: Final = "confidence/confidence.json"
CONFIDENCE_PREFIX: Final = "confidence."
SOFTMAX_FEATURES: Final = 3  # log p_max, log p_max - log p_second, entropy
HEAD_INPUTS: Final = ("h", "e", "softmax", "position")  # in the order they are concatenated


def softmax_features(logits: torch.Tensor) -> torch.Tensor:
    """``[..., V]`` draft logits -> ``[..., 3]`` fp32: the log of the top probability, the
    log-ratio of the top two, and the entropy of ``softmax(logits)``."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top = lp.topk(2, dim=-1).values
    entropy = -(lp.exp() * lp).sum(dim=-1)
    return torch.stack([top[..., 0], top[..., 0] - top[..., 1], entropy], dim=-1)


@dataclass(frozen=True)
class ConfidenceConfig:
    hidden_size: int  # D: h_k and e_k are [D] each
    softmax: bool = False  # the draft distribution's `softmax_features` follow [h ; e]
    positions: int = 0  # > 0: then a one-hot of the draft's position 1..positions

    def __post_init__(self) -> None:
        if self.hidden_size < 1 or self.positions < 0:
            raise ValueError(f"hidden_size >= 1 and positions >= 0, got {self.hidden_size}, {self.positions}")

    @property
    def linear_width(self) -> int:
        """Inputs of the linear part, ``[h ; e]`` and the softmax features."""
        return 2 * self.hidden_size + SOFTMAX_FEATURES * self.softmax

    @property
    def width(self) -> int:
        """Every input, the position's one-hot included (what the training stage fits)."""
        return self.linear_width + self.positions

    @property
    def inputs(self) -> str:
        """The inputs as ``sluice train confidence --inputs`` names them: ``"h,e"``, then
        ``",softmax"`` and ``",position"`` where the head reads them."""
        return ",".join(["h", "e"] + ["softmax"] * self.softmax + ["position"] * (self.positions > 0))

    @classmethod
    def parse(cls, hidden_size: int, inputs: str, positions: int = 0) -> ConfidenceConfig:
        """``inputs``: comma-separated names of `HEAD_INPUTS`, ``h`` and ``e`` first (ValueError
        otherwise); ``positions``: how many draft positions the one-hot has (with ``position``)."""
        names = [n.strip() for n in inputs.split(",") if n.strip()]
        if names[:2] != ["h", "e"] or len(set(names)) != len(names) or not set(names) <= set(HEAD_INPUTS):
            raise ValueError(
                f"confidence head inputs {inputs!r}: 'h,e' then any of 'softmax', 'position' (in that order)"
            )
        if names != [n for n in HEAD_INPUTS if n in names]:
            raise ValueError(
                f"confidence head inputs {inputs!r} are out of order; the order is {HEAD_INPUTS}"
            )
        if ("position" in names) != (positions > 0):
            raise ValueError(
                f"confidence head inputs {inputs!r} with positions={positions}: give both or neither"
            )
        return cls(hidden_size, softmax="softmax" in names, positions=positions)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ConfidenceConfig:
        """A ``[h ; e]`` head of ``config.json``'s ``hidden_size``."""
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        return cls(hidden_size=int(cfg["hidden_size"]))


class ConfidenceHead(nn.Module):
    """``p = sigmoid(Linear([h ; e ; ...]))``; ``h``, ``e`` [..., D] -> ``p`` [...] in fp32.

    ``logits`` (the draft's, [..., V]) are needed when the head reads ``softmax``, and
    ``position`` (the draft's, 1-based, the same for every row) when it reads ``position``:
    its one-hot's weight, ``position_bias[position - 1]``, is added to the bias."""

    def __init__(self, cfg: ConfidenceConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.confidence = nn.Linear(cfg.linear_width, 1, bias=True)
        self.position_bias = nn.Parameter(torch.zeros(cfg.positions))

    def tensors(self) -> dict[str, torch.Tensor]:
        """The weight file's tensors (`CONFIDENCE_PREFIX` names), fp32 on the host."""
        out = {"weight": self.confidence.weight, "bias": self.confidence.bias}
        if self.cfg.positions:
            out["position"] = self.position_bias
        return {CONFIDENCE_PREFIX + k: v.detach().float().cpu().contiguous() for k, v in out.items()}

    def forward(
        self,
        h: torch.Tensor,
        prev_emb: torch.Tensor,
        logits: torch.Tensor | None = None,
        position: int | None = None,
        *,
        logit: bool = False,
    ) -> torch.Tensor:
        """The confidence (``logit``: its logit) of each row, fp32."""
        cfg = self.cfg
        if h.shape != prev_emb.shape or h.shape[-1] != cfg.hidden_size:
            raise ValueError(
                f"h {tuple(h.shape)} and prev_emb {tuple(prev_emb.shape)} must both be [..., {cfg.hidden_size}]"
            )
        parts = [h, prev_emb]
        if cfg.softmax:
            if logits is None or logits.shape[:-1] != h.shape[:-1]:
                raise ValueError("this confidence head reads the draft's softmax: pass its logits [..., V]")
            parts.append(softmax_features(logits))
        out = self.confidence(torch.cat(parts, dim=-1).to(self.confidence.weight.dtype))
        if cfg.positions:
            if position is None or not 1 <= position <= cfg.positions:
                raise ValueError(
                    f"this confidence head reads the draft position, 1..{cfg.positions}; got {position}"
                )
            out = out + self.position_bias[position - 1]
        out = out.squeeze(-1).float()
        return out if logit else torch.sigmoid(out)


def mtp_head_inputs(
    model: DeepseekV4, mtp_out: torch.Tensor, next_ids: torch.Tensor, rows: torch.Tensor, depth: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's ``(h, e)`` for the sampled rows of an MTP pass, from what ``forward_mtp`` takes
    and returns: ``mtp_out`` [T, hc, D] its output streams, ``next_ids`` [T] its input tokens,
    ``rows`` the batch's ``sample_indices`` -> ``h``, ``e`` [num_sampled, D]."""
    from engine.model.mtp import MTPLayer

    layer = cast(MTPLayer, model.mtp[depth])
    h = layer.norm(layer.hc_head(mtp_out[rows]))
    e = model.model.embed_tokens(next_ids[rows])
    return h, e


def load_confidence_head(
    model_dir: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> ConfidenceHead | None:
    """The checkpoint's confidence head from `CONFIDENCE_WEIGHTS`, or None when that file is absent.

    Exactly ``confidence.weight`` [1, 2D] (or [1, 2D + 3]: the head reads ``softmax``) and
    ``confidence.bias`` [1] must be there, and ``confidence.position`` [positions] for a head
    reading ``position``; ``D`` is config.json's ``hidden_size`` (ValueError otherwise).
    """
    from safetensors import safe_open

    root = Path(model_dir)
    path = root / CONFIDENCE_WEIGHTS
    if not path.is_file():
        return None
    hidden = ConfidenceConfig.from_dir(root).hidden_size
    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())  # noqa: SIM118 - safe_open handles are not mappings
        state = {name: f.get_tensor(name).to(torch.float32) for name in names}
    weight = state.get(CONFIDENCE_PREFIX + "weight")
    position = state.get(CONFIDENCE_PREFIX + "position")
    cfg = ConfidenceConfig(
        hidden,
        softmax=weight is not None and weight.shape[-1] == 2 * hidden + SOFTMAX_FEATURES,
        positions=int(position.shape[0]) if position is not None and position.dim() else 0,
    )
    head = ConfidenceHead(cfg)
    want = {k: v.shape for k, v in head.tensors().items()}
    if names != set(want):
        raise ValueError(f"{path}: tensors {sorted(names)}, expected {sorted(want)}")
    for name, shape in want.items():
        if state[name].shape != shape:
            raise ValueError(f"{path}: {name} has shape {tuple(state[name].shape)}, expected {tuple(shape)}")
    with torch.no_grad():
        head.confidence.weight.copy_(state[CONFIDENCE_PREFIX + "weight"])
        head.confidence.bias.copy_(state[CONFIDENCE_PREFIX + "bias"])
        if cfg.positions:
            head.position_bias.copy_(state[CONFIDENCE_PREFIX + "position"])
    return head.to(device=device, dtype=dtype).eval()
