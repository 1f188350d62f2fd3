"""Random weights drawn in place on the model's device: no checkpoint file, no host copy.

For benchmarks at real widths (flash-shape: ~13 GB of bf16 experts per layer), where writing
and reading a checkpoint would cost minutes. The rules follow `engine.checkpoint.generate`
(unit-variance projections, norms near 1, randomised sinks / biases / hash table), but values
come from device generators, so they differ from a generated checkpoint's.

Deterministic identity: every tensor has its own generator seeded by (seed, name), and each
routed expert slot by (seed, layer name, *logical* expert id), so a rank holding a subset of
the experts under EP (or a replica of one under EPLB) holds exactly the tensors a single
rank holding all of them would, on the same kind of device.
"""

from __future__ import annotations

import hashlib
import math

import torch

from engine.model.model import DeepseekV4
from engine.model.moe import MoE


def seed_for(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _gen(device: torch.device, seed: int, name: str) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed_for(seed, name))


def _fill(name: str, t: torch.Tensor, seed: int, n_experts: int) -> None:
    g = _gen(t.device, seed, name)
    shape, dev = t.shape, t.device
    if name.endswith("tid2eid"):  # distinct experts per token id
        rows = torch.rand(shape[0], n_experts, generator=g, device=dev).argsort(dim=1)[:, : shape[1]]
        t.copy_(rows)
        return
    if name.endswith(("sinks", "position_bias")):
        values = torch.randn(shape, generator=g, device=dev)
    elif name.endswith("e_score_correction_bias"):
        values = 0.1 * torch.randn(shape, generator=g, device=dev)
    elif name.endswith(("hc_base", ".base")):
        values = 0.5 * torch.randn(shape, generator=g, device=dev)
    elif name.endswith(("hc_scale", ".scale")):
        values = 0.5 + torch.rand(shape, generator=g, device=dev)
    elif "norm" in name and len(shape) == 1:
        values = 1.0 + 0.1 * torch.randn(shape, generator=g, device=dev)
    elif name.endswith("embed_tokens.weight"):
        values = torch.randn(shape, generator=g, device=dev)
    else:  # projections: unit-variance outputs, whatever the fan-in
        values = torch.randn(shape, generator=g, device=dev) / math.sqrt(shape[-1])
    t.copy_(values)


def _fill_experts(prefix: str, moe: MoE, seed: int) -> None:
    """Each physical slot gets the tensors of the logical expert it holds."""
    logical = moe.placement.local_logical(moe.ep_rank)
    for which in ("gate_up_proj", "down_proj"):
        w = getattr(moe.experts, which).data  # [slots, out, in]
        for slot, e in enumerate(logical):
            g = _gen(w.device, seed, f"{prefix}.experts.{which}#{e}")
            draw = torch.randn(w.shape[1:], generator=g, device=w.device) / math.sqrt(w.shape[-1])
            w[slot].copy_(draw)


@torch.no_grad()
def randomize_(model: DeepseekV4, seed: int = 0) -> None:
    """Overwrite every parameter (and the router buffers) of ``model`` with seeded random values."""
    n_experts = model.cfg.n_routed_experts
    moes = {name: m for name, m in model.named_modules() if isinstance(m, MoE)}
    expert_params = {f"{p}.experts.{w}" for p in moes for w in ("gate_up_proj", "down_proj")}
    for name, p in model.named_parameters():
        if name not in expert_params:
            _fill(name, p.data, seed, n_experts)
    for name, b in model.named_buffers():
        if name.endswith(("tid2eid", "e_score_correction_bias")):
            _fill(name, b, seed, n_experts)
    for prefix, moe in moes.items():
        _fill_experts(prefix, moe, seed)
