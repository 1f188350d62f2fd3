"""Dequantisation of DeepSeek's released weight formats (filled in below)."""

from __future__ import annotations

import torch

def is_scale_key(src, key: str) -> bool:
    """A quantisation scale (``X.weight_scale_inv`` or ``X.scale`` beside ``X.weight``), not a parameter."""
    if key.endswith("_scale_inv"):
        return True
    return key.endswith(".scale") and key.removesuffix("scale") + "weight" in src


def find_scale(src, key: str) -> str | None:
    for cand in (key + "_scale_inv", key.removesuffix("weight") + "scale"):
        if cand != key and cand in src:
            return cand
    return None


def dequantize(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    raise NotImplementedError
