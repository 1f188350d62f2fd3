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

``p_k`` estimates the probability that draft ``k`` equals the target's token *given every
earlier draft of the step was accepted* (how it was trained: ``engine/train/confidence.py``),
so ``p_1 * ... * p_k`` estimates that the first ``k`` drafts are all accepted.

The head ships beside a checkpoint in its own file, ``confidence/model.safetensors`` (keys
``confidence.weight`` [1, 2D] and ``confidence.bias`` [1], fp32), so the main weight shards
stay exactly what transformers loads; ``confidence/confidence.json`` beside it records how it
was trained and how well it is calibrated. ``D`` is config.json's ``hidden_size``.
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


@dataclass(frozen=True)
class ConfidenceConfig:
    hidden_size: int  # D: h_k and e_k are [D] each

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ConfidenceConfig:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        return cls(hidden_size=int(cfg["hidden_size"]))


class ConfidenceHead(nn.Module):
    """``p = sigmoid(Linear([h ; e]))``; ``h``, ``e`` [..., D] -> ``p`` [...] in fp32."""

    def __init__(self, cfg: ConfidenceConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.confidence = nn.Linear(2 * cfg.hidden_size, 1, bias=True)

    def logit(self, h: torch.Tensor, prev_emb: torch.Tensor) -> torch.Tensor:
        if h.shape != prev_emb.shape or h.shape[-1] != self.cfg.hidden_size:
            raise ValueError(
                f"h {tuple(h.shape)} and prev_emb {tuple(prev_emb.shape)} must both be [..., {self.cfg.hidden_size}]"
            )
        w = self.confidence.weight
        x = torch.cat([h, prev_emb], dim=-1).to(w.dtype)
        return self.confidence(x).squeeze(-1).float()

    def forward(self, h: torch.Tensor, prev_emb: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logit(h, prev_emb))


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

    Exactly the tensors ``confidence.weight`` [1, 2D] and ``confidence.bias`` [1] must be there,
    ``D`` being config.json's ``hidden_size`` (ValueError otherwise).
    """
    from safetensors import safe_open

    root = Path(model_dir)
    path = root / CONFIDENCE_WEIGHTS
    if not path.is_file():
        return None
    cfg = ConfidenceConfig.from_dir(root)
    head = ConfidenceHead(cfg)
    want = {CONFIDENCE_PREFIX + k: v.shape for k, v in head.confidence.state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())  # noqa: SIM118 - safe_open handles are not mappings
        if names != set(want):
            raise ValueError(f"{path}: tensors {sorted(names)}, expected {sorted(want)}")
        for name, shape in want.items():
            t = f.get_tensor(name)
            if t.shape != shape:
                raise ValueError(f"{path}: {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
            state[name[len(CONFIDENCE_PREFIX) :]] = t.to(torch.float32)
    head.confidence.load_state_dict(state)
    return head.to(device=device, dtype=dtype).eval()
