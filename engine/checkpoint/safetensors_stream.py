"""Write safetensors files one tensor at a time.

``safetensors.torch.save_file`` needs every tensor in memory at once; a flash-shape
checkpoint does not fit that way. The format is simple (an 8-byte little-endian header
length, a JSON header of dtype/shape/offsets, then the raw bytes in header order), so the
header is computed from the planned shapes first and each tensor is produced, written and
dropped in turn.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = {
    torch.float32: ("F32", 4),
    torch.bfloat16: ("BF16", 2),
    torch.float16: ("F16", 2),
    torch.int64: ("I64", 8),
    torch.int32: ("I32", 4),
    torch.int8: ("I8", 1),
    torch.uint8: ("U8", 1),
    torch.float8_e4m3fn: ("F8_E4M3", 1),
    torch.float8_e8m0fnu: ("F8_E8M0", 1),
}


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _DTYPES[self.dtype][1]


def write_streaming(
    path: Path,
    plans: Iterable[TensorPlan],
    produce: Callable[[TensorPlan], Iterator[torch.Tensor]],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write ``plans`` to ``path``.

    ``produce(plan)`` yields the tensor in row blocks (slices along dim 0, in order) when its
    turn comes, so even a single tensor larger than memory can be written.
    """
    plans = list(plans)
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for plan in plans:
        if plan.dtype not in _DTYPES:
            raise ValueError(f"{plan.name}: dtype {plan.dtype} is not supported by the writer")
        header[plan.name] = {
            "dtype": _DTYPES[plan.dtype][0],
            "shape": list(plan.shape),
            "data_offsets": [offset, offset + plan.nbytes],
        }
        offset += plan.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for plan in plans:
            written = 0
            for block in produce(plan):
                if block.dtype != plan.dtype or tuple(block.shape[1:]) != plan.shape[1:]:
                    raise ValueError(
                        f"{plan.name}: produced {block.dtype} {tuple(block.shape)}, planned {plan}"
                    )
                if block.numel():
                    f.write(block.contiguous().view(torch.uint8).numpy().data)
                written += block.numel() * block.element_size()
            if written != plan.nbytes:
                raise ValueError(f"{plan.name}: produced {written} bytes, planned {plan.nbytes}")
    tmp.replace(path)
