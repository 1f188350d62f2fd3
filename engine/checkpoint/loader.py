"""Load a DeepSeek-V4 checkpoint (Hugging Face safetensors) into `DeepseekV4`.

Sharded (``model.safetensors.index.json``, or every ``*.safetensors`` in the folder) or
single-file; key spellings as in `engine.checkpoint.keys`. bf16/fp32 tensors are cast to the
model dtype; FP8 block-scaled linears and FP4 experts are dequantised on the way in
(`engine.checkpoint.quant`). Under expert parallelism only this rank's physical experts are read.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from engine.checkpoint.keys import KeyRef, canonical
from engine.checkpoint.quant import dequantize, find_scale, is_scale_key
from engine.model.experts import Experts
from engine.model.model import DeepseekV4
from engine.model.moe import MoE
from engine.model.qlinear import replace_linear


def checkpoint_files(path: str | Path) -> list[Path]:
    root = Path(path)
    index = root / "model.safetensors.index.json"
    files = sorted(root.glob("*.safetensors"))
    if index.exists():
        listed = {root / n for n in json.loads(index.read_text())["weight_map"].values()}
        files = sorted(listed | set(files))
    if not files:
        raise FileNotFoundError(f"no *.safetensors under {root}")
    return files


class TensorSource:
    """Read-by-name access across the shards of a checkpoint."""

    def __init__(self, path: str | Path) -> None:
        self._where: dict[str, Path] = {}
        for f in checkpoint_files(path):
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():  # noqa: SIM118 - safe_open handles are not mappings
                    self._where[k] = f

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def get(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        with safe_open(str(self._where[key]), framework="pt") as h:
            if rows is None:
                return h.get_tensor(key)
            return h.get_slice(key)[rows[0] : rows[1]]


class _Loader:
    def __init__(self, model: DeepseekV4, src: TensorSource, keep_quantized: bool) -> None:
        self.src, self.model, self.keep = src, model, keep_quantized
        self.state = model.state_dict()
        self.seen: set[str] = set()
        self.expert_parts: dict[str, set[tuple[int, str]]] = {}  # packed name -> (local slot, part)
        self.unused: list[str] = []

    def _local_logical(self, packed_name: str) -> list[int]:
        """Logical expert of each of this rank's physical slots, for the MoE owning ``packed_name``."""
        moe = self.model.get_submodule(packed_name.rsplit(".experts.", 1)[0])
        if not isinstance(moe, MoE):
            raise ValueError(f"{packed_name}: expected a MoE module")
        return moe.placement.local_logical(moe.ep_rank)

    def _get_rows(self, key: str, logical: list[int] | None) -> torch.Tensor:
        if logical is None:
            return self.src.get(key)
        lo, n = logical[0], len(logical)
        if logical == list(range(lo, lo + n)):
            return self.src.get(key, (lo, lo + n))
        return torch.cat([self.src.get(key, (e, e + 1)) for e in logical])  # replicas / scattered slots

    def _read(self, key: str, logical: list[int] | None = None) -> torch.Tensor:
        t = self._get_rows(key, logical)
        scale_key = find_scale(self.src, key)
        if scale_key is None:
            return t
        return dequantize(t, self._get_rows(scale_key, logical))

    def _store(self, name: str, t: torch.Tensor, dst: torch.Tensor) -> None:
        if dst.shape != t.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)} != model shape {tuple(dst.shape)}")
        dst.copy_(t.to(dst.dtype))

    def load_key(self, key: str) -> None:
        ref = canonical(key)
        if ref.name not in self.state:
            self.unused.append(key)
            return
        dst = self.state[ref.name]
        if ref.expert >= 0:
            self._load_expert(key, ref, dst)
            return
        packed = ref.name.endswith(("experts.gate_up_proj", "experts.down_proj"))
        logical = self._local_logical(ref.name) if packed else None
        scale_key = find_scale(self.src, key) if self.keep else None
        if scale_key is not None and (packed or ref.name.endswith(".weight")):
            self._keep_quantized(key, scale_key, ref.name, logical)
            return
        self._store(ref.name, self._read(key, logical), dst)
        self.seen.add(ref.name)

    def _keep_quantized(self, key: str, scale_key: str, name: str, logical: list[int] | None) -> None:
        q, scale = self._get_rows(key, logical), self._get_rows(scale_key, logical)
        owner, _, leaf = name.rpartition(".")
        if logical is not None:
            experts = self.model.get_submodule(owner)
            if not isinstance(experts, Experts):
                raise ValueError(f"{name}: expected an Experts module at {owner}")
            experts.set_quantized(leaf, q, scale)
        else:
            replace_linear(self.model, owner, q, scale)
        self.seen.add(name)

    def _load_expert(self, key: str, ref: KeyRef, dst: torch.Tensor) -> None:
        slots = [i for i, e in enumerate(self._local_logical(ref.name)) if e == ref.expert]
        if not slots:
            return
        t = self._read(key)
        for i in slots:
            row = dst[i]  # [2I, H] or [H, I]
            if ref.part == "w2":
                self._store(key, t, row)
            else:
                half = row.shape[0] // 2
                self._store(key, t, row[:half] if ref.part == "w1" else row[half:])
            self.expert_parts.setdefault(ref.name, set()).add((i, ref.part))

    def finish(self, path: str | Path, strict: bool) -> list[str]:
        need = {"experts.gate_up_proj": ("w1", "w3"), "experts.down_proj": ("w2",)}
        for name, parts in self.expert_parts.items():
            want = next(v for k, v in need.items() if name.endswith(k))
            n_local = len(self._local_logical(name))
            if all((i, p) in parts for i in range(n_local) for p in want):
                self.seen.add(name)
        missing = [k for k in self.state if k not in self.seen]
        if strict and missing:
            raise ValueError(f"checkpoint {path} lacks {len(missing)} model tensors, e.g. {missing[:5]}")
        return self.unused


def load_weights(
    model: DeepseekV4, path: str | Path, strict: bool = True, keep_quantized: bool = False
) -> list[str]:
    """Copy every checkpoint tensor into ``model``; return the checkpoint keys the model has no slot for.

    With ``keep_quantized``, FP8/FP4 linears become `QuantLinear` and packed quantised experts stay
    packed (DeepSeek's per-expert keys are still dequantised at load). Raises ValueError when a
    model tensor is missing from the checkpoint (``strict``) or a shape does not match.
    """
    src = TensorSource(path)
    loader = _Loader(model, src, keep_quantized)
    with torch.no_grad():
        for key in src.names():
            if not is_scale_key(src, key):
                loader.load_key(key)
    return loader.finish(path, strict)
