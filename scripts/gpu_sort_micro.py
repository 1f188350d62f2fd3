"""Does the indexer's ranking cost on the GPU depend on the scores, as torch's CPU sort does
(equal scores sort 5.6x faster than varied ones at 16 x 4,096)?

Usage (a CUDA host): python3 scripts/gpu_sort_micro.py > sort_micro.json

Times ``torch.sort`` and ``torch.topk(k=512)`` over rows of zeros and of normal samples,
with CUDA events over 20 calls after 3 untimed ones; prints milliseconds per call as JSON.
The decode profile's A/B (``sluice bench router --profile-decode --zeroed-caches``) measures
the same question on whole engine steps.
"""

from __future__ import annotations

import json

import torch

SHAPES = ((16, 4096), (64, 16384), (256, 16384), (16, 262144))


def main() -> None:
    out = {}
    for rows, cols in SHAPES:
        for kind in ("zeros", "randn"):
            x = (
                torch.zeros(rows, cols, device="cuda")
                if kind == "zeros"
                else torch.randn(rows, cols, device="cuda")
            )
            ops = {
                "sort": lambda x=x: torch.sort(x, dim=-1, descending=True),
                "topk512": lambda x=x: torch.topk(x, min(512, x.shape[-1]), dim=-1),
            }
            for op, f in ops.items():
                for _ in range(3):
                    f()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(20):
                    f()
                end.record()
                torch.cuda.synchronize()
                out[f"{op} {rows}x{cols} {kind}"] = round(start.elapsed_time(end) / 20, 4)
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "ms_per_call": out}, indent=1))


if __name__ == "__main__":
    main()
