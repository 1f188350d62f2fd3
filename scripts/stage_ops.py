"""Operators a speculative step's staging of ring rows dispatches (`SWASlots.stage`, then
`StagedRows.undo` with some positions rejected), and its time on this CPU.

On a GPU each operator is a kernel launch, which at these sizes costs more than the copy. It
counts every dispatched aten operator but views (`scripts/step_ops.py`'s rule) through a
`TorchDispatchMode`, for the slots of the trained preset and of V4-Flash's shape (43 layers,
``flash-shape`` widths, no weights), 60 requests verifying 5 drafts each, 2 of them rejected.
Run it from a directory holding another revision's ``engine/`` to compare the two.

    .venv/bin/python scripts/stage_ops.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from step_ops import VIEWS  # scripts/step_ops.py, beside this one: the same operators left out
from torch.utils._python_dispatch import TorchDispatchMode

from engine.cache.spec import CacheSpec
from engine.cache.swa import SWASlots
from engine.checkpoint.generate import write_config_dir
from engine.config import ModelConfig

TRAINED = Path(__file__).resolve().parent.parent / "models" / "trained"
FLASH_43: dict[str, Any] = {
    "num_hidden_layers": 43,
    "layer_types": ["sliding_attention"]
    + ["compressed_sparse_attention", "heavily_compressed_attention"] * 21,
    "mlp_layer_types": ["hash_moe"] * 3 + ["moe"] * 40,
}


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def,unused-ignore]
        self.ops += func.overloadpacket.__name__ not in VIEWS
        return func(*args, **(kwargs or {}))


def main() -> None:
    torch.set_num_threads(1)
    for name in ("trained", "flash-shape"):
        model = TRAINED
        if name == "flash-shape":
            model = write_config_dir(name, Path(tempfile.mkdtemp()) / name, **FLASH_43)
        cfg = ModelConfig.from_dir(model)
        swa = SWASlots(CacheSpec.from_model(cfg), 64, torch.bfloat16, "cpu")
        slots = [s for s in range(60) for _ in range(5)]
        positions = [1000 + j for _ in range(60) for j in range(1, 6)]
        rejected = [j >= 3 for _ in range(60) for j in range(5)]
        layers = range(cfg.num_hidden_layers)
        swa.stage(layers, slots, positions).undo(rejected)  # builds what a runner then reuses
        with Count() as count:
            swa.stage(layers, slots, positions).undo(rejected)
        times = []
        for _ in range(30):
            t0 = time.perf_counter()
            swa.stage(layers, slots, positions).undo(rejected)
            times.append(time.perf_counter() - t0)
        rings = len(swa.layer_rings(layers))
        print(
            f"{name}: {cfg.num_hidden_layers} layers, {rings} rings: {count.ops} operators, "
            f"{statistics.median(times) * 1e3:.2f} ms on this CPU (median of 30)"
        )


if __name__ == "__main__":
    main()
